"""The fa backend's kernel from upstream flash_attn_interface (attention/fa.py): its forward is a torch.library
custom op whose first call imports torch's compiler stack; `without_custom_op` gives a copy of the caller that runs
the op's own body. Checked on a module built like flash_attn_interface: the same results, the module untouched, and
no torch._dynamo import."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FAKE_INTERFACE = textwrap.dedent('''
    import torch

    @torch.library.custom_op("fake_fa3::_forward", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, scale: float) -> torch.Tensor:
        return q * scale

    def flash_attn_with_kvcache(q, *, softmax_scale=2.0):
        return _flash_attn_forward(q, softmax_scale) + 1
''')

CHECK = textwrap.dedent('''
    import sys, types, torch
    module = types.ModuleType("fake_interface")
    exec(sys.argv[1], module.__dict__)
    from minisrv.attention.fa import without_custom_op
    fn = without_custom_op(module.flash_attn_with_kvcache, "_flash_attn_forward")
    q = torch.arange(4.0)
    assert fn is not module.flash_attn_with_kvcache
    assert torch.equal(fn(q), q * 2 + 1) and torch.equal(fn(q, softmax_scale=3.0), q * 3 + 1)
    assert "torch._dynamo" not in sys.modules, "the copy went through the custom op"
    assert module._flash_attn_forward.__class__.__name__ == "CustomOpDef"  # the module is left as it is
    plain = lambda q: q
    assert without_custom_op(plain, "_flash_attn_forward") is plain
    assert torch.equal(module.flash_attn_with_kvcache(q), q * 2 + 1)  # the op itself: same result
    print("ok")
''')


@pytest.mark.slow
def test_copy_runs_the_ops_body_without_importing_the_compiler():
    out = subprocess.run([sys.executable, "-c", CHECK, FAKE_INTERFACE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
