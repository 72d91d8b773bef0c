"""Who may use the server: anyone on this machine over loopback; a bearer token otherwise.

Only 127.0.0.1, ::1 and `localhost` count as loopback. Any other address, including the rest
of 127.0.0.0/8, needs the token: such addresses are what port forwards and containers use, and
being strict costs a local user nothing. The token lives in the OS keyring (`macaron auth
api-token`) and is compared in constant time.
"""

from __future__ import annotations

import hmac

from macaron_local import secrets
from macaron_local.errors import MacaronError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    return host.strip("[]").lower() in LOOPBACK


def token_for_bind(host: str) -> str | None:
    """The token a server bound to `host` requires (None on loopback); an error when a
    non-loopback bind has no token in the keyring."""
    if is_loopback(host):
        return None
    token = secrets.get_api_token()
    if not token:
        raise MacaronError(
            f"binding to {host} exposes the API beyond this machine's loopback and needs a token: "
            "run `macaron auth api-token` first"
        )
    return token


def authorized(header: str | None, token: str | None) -> bool:
    """Is `header` (the Authorization header) good for a server that requires `token`?"""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())
