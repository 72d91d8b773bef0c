"""`macaron serve [--host H] [--port N]`: the session as an OpenAI-compatible API on this machine.

Loopback (127.0.0.1, the default) needs no token; any other address needs the bearer token from
`macaron auth api-token`, kept in the OS keyring. The model loads before the port is announced,
so a missing model is one error line, not a server that fails its first request.
"""

from __future__ import annotations

import argparse
import socket
import sys

from macaron_local.cli.common import add_model_option, load_settings
from macaron_local.errors import InvalidInputError, MacaronError

DEFAULT_PORT = 8765


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve an OpenAI-compatible API (Chat Completions) on this machine")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument("--max-tokens", type=int, help="longest reply a request may get (default 2048)")
    parser.add_argument("--queue", type=int, help="generations that may wait behind the running one (default 16)")
    parser.add_argument("--max-body", type=int, metavar="BYTES", help="largest request body (default 4 MiB)")
    add_model_option(parser)
    parser.set_defaults(func=run)


def listen(host: str, port: int) -> socket.socket:
    """Bind first, so a taken port or a foreign address is one clear error."""
    if not 0 <= port <= 65535:
        raise InvalidInputError(f"--port must be between 0 and 65535 (got {port})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise MacaronError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from macaron_local.server import Limits, create_app
    from macaron_local.server.auth import token_for_bind
    from macaron_local.session import Session

    limits = Limits()
    overrides = {"max_tokens": args.max_tokens, "queue": args.queue, "max_body_bytes": args.max_body}
    for name, value in overrides.items():
        if value is not None and value < (0 if name == "queue" else 1):
            raise InvalidInputError(f"--{name.replace('_', '-')} must be positive (got {value})")
    limits = Limits(**{k: v for k, v in {**limits.__dict__, **overrides}.items() if v is not None})
    token = token_for_bind(args.host)
    session = Session(load_settings(), model=args.model)
    try:
        session.load()
        sock = listen(args.host, args.port)
    except BaseException:
        session.close()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    app = create_app(lambda: session, limits=limits, token=token)
    auth = "bearer token required" if token else "loopback, no token"
    print(f"serving {session.manifest.name} on http://{shown}:{port}/v1 ({auth}); Ctrl-C stops", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn finished its graceful shutdown, then passed Ctrl-C on: a normal stop
    finally:
        sock.close()
    print("stopped", file=sys.stderr)
    return 0
