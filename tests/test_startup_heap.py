"""utils.freeze_startup_heap: what the server's engine process, the tensor-parallel ranks and the generate script
call once their engine is built, so that Python's full garbage collections stop walking the start-up heap. Each
check runs in a fresh process: a freeze in the test process would keep every later test's engine cycles alive."""
from __future__ import annotations

import subprocess
import sys
import textwrap

FREEZE_CHECK = textwrap.dedent('''
    import gc, weakref
    from minisrv.utils import freeze_startup_heap

    class Node:
        pass

    def garbage_cycle():
        a, b = Node(), Node()
        a.b, b.a = b, a
        return weakref.ref(a)

    gc.disable()  # only the calls below collect
    dead_before = garbage_cycle()
    live = Node()
    live.self = live
    freeze_startup_heap()
    assert dead_before() is None, "a cycle that was garbage at the freeze was frozen, not collected"
    assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imports' objects, torch's among them
    assert not any(o is live for o in gc.get_objects()), "a live object is still in the collector's walk"
    dead_after = garbage_cycle()
    gc.collect()
    assert dead_after() is None, "a cycle made after the freeze was not collected"
    gc.unfreeze()
    assert any(o is live for o in gc.get_objects()), "unfreeze did not give the objects back to the collector"
    print("ok")
''')


def test_freeze_collects_garbage_then_keeps_live_objects_out_of_the_walk():
    out = subprocess.run([sys.executable, "-c", FREEZE_CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
