"""`macaron serve`: the session behind an OpenAI-compatible HTTP API on this machine.

One module per job: `schemas` (what a request may hold), `tools` (the tool-call text format),
`limits` (body size, the generation queue), `auth` (the bearer token off loopback), `worker`
(the one thread that owns the session) and `app` (the Starlette routes).
"""

from macaron_local.server.app import create_app
from macaron_local.server.limits import Limits

__all__ = ["Limits", "create_app"]
