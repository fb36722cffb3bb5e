"""The HTTP layer every request passes before its route: who may call (policy.py, headers.py), the gate itself
(gate.py), the body bounded in size and time (body.py) and parsed strictly into the route's schema (json_body.py),
and what minisrv adds to uvicorn's connections (transport.py)."""
