"""The HTTP layer every request passes before its route: who may call (policy.py, headers.py), the gate itself and
the body bounded in size and time (gate.py), the body parsed strictly into the route's schema (json_body.py),
and what minisrv adds to uvicorn's connections (transport.py)."""
