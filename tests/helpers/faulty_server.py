"""`python -m tests.helpers.faulty_server [server flags]`: the server, whose engine fails every step that holds a
request whose prompt contains FAULT_TOKEN (how the engine survives a request that breaks its step).

The engine process is spawned, and spawn runs the parent's main module again in it as `__mp_main__`: the model
runner's launch is wrapped there, at import, before the engine is built. The HTTP process is left as it is."""
from __future__ import annotations

FAULT_TOKEN = 4242


def _fail_on_fault_token(launch):
    def launch_or_fail(self, sb, *args, **kwargs):
        if any(FAULT_TOKEN in r.prompt_ids for r in sb.reqs):
            raise RuntimeError(f"injected fault: a request's prompt holds token {FAULT_TOKEN}")
        return launch(self, sb, *args, **kwargs)
    return launch_or_fail


if __name__ == "__mp_main__":
    from minisrv.engine.model_runner import ModelRunner

    ModelRunner.launch = _fail_on_fault_token(ModelRunner.launch)

if __name__ == "__main__":
    from minisrv.server.launch_server import main

    main()
