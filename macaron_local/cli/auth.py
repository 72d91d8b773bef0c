"""`macaron auth login|logout|status`: the Hugging Face token, kept in the OS keyring only.

The token is read from a hidden prompt (or stdin when piped), never from the command line,
where it would land in shell history and `ps`. It is stored with `keyring` (macOS Keychain,
Secret Service, Windows Credential Locker) and never written to a file or printed.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys

import keyring
from keyring.errors import KeyringError, PasswordDeleteError

from macaron_local import secrets
from macaron_local.errors import InvalidInputError, MacaronError


class KeyringUnavailableError(MacaronError):
    """No usable OS keyring: the token cannot be kept safely."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("auth", help="keep a Hugging Face token in the OS keyring (for gated downloads)")
    actions = parser.add_subparsers(dest="auth_command", metavar="ACTION", required=True)
    login = actions.add_parser("login", help="store a token (prompted, or read from stdin)")
    login.set_defaults(func=run_login)
    logout = actions.add_parser("logout", help="remove the stored token")
    logout.set_defaults(func=run_logout)
    status = actions.add_parser("status", help="is a token stored? (never shows it)")
    status.set_defaults(func=run_status)
    api = actions.add_parser(
        "api-token", help="make a new bearer token for `macaron serve` off loopback (printed once)"
    )
    api.add_argument("--delete", action="store_true", help="remove it: non-loopback serving stops working")
    api.set_defaults(func=run_api_token)
    engine = actions.add_parser(
        "engine-token", help="store the bearer token a remote engine wants (prompted, or read from stdin)"
    )
    engine.add_argument("--delete", action="store_true", help="remove it")
    engine.set_defaults(func=run_engine_token)
    trainer = actions.add_parser("tinker-key", help="store the Tinker/MinT API key for remote training")
    trainer.set_defaults(func=run_tinker_key)


def _backend() -> str:
    backend = keyring.get_keyring()
    return getattr(backend, "name", type(backend).__name__)


def _unavailable(exc: KeyringError) -> KeyringUnavailableError:
    return KeyringUnavailableError(
        f"no usable OS keyring ({type(exc).__name__}); unlock or install one, or set HF_TOKEN for a single shell"
    )


def read_token(what: str = "Hugging Face token") -> str:
    if sys.stdin is not None and sys.stdin.isatty():
        token = getpass.getpass(f"{what} (input hidden): ")
    else:
        token = sys.stdin.readline() if sys.stdin is not None else ""
    token = token.strip()
    if not token:
        hint = "; create one at https://huggingface.co/settings/tokens" if what.startswith("Hugging") else ""
        raise InvalidInputError(f"no token given{hint}")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise InvalidInputError("that does not look like a token: it contains spaces or control characters")
    return token


def run_login(args: argparse.Namespace) -> int:
    token = read_token()
    try:
        secrets.set_hf_token(token)
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print(f"token stored in the OS keyring ({_backend()})")
    if os.environ.get("HF_TOKEN"):
        print("note: HF_TOKEN is set in this environment and takes precedence over the stored token")
    return 0


def run_logout(args: argparse.Namespace) -> int:
    try:
        had = keyring.get_password(secrets.SERVICE, secrets.HF_TOKEN_KEY) is not None
        if had:
            keyring.delete_password(secrets.SERVICE, secrets.HF_TOKEN_KEY)
    except PasswordDeleteError:
        had = False
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print("token removed from the OS keyring" if had else "no token was stored")
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        stored = keyring.get_password(secrets.SERVICE, secrets.HF_TOKEN_KEY) is not None
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print(f"a token is stored in the OS keyring ({_backend()})" if stored else "no token is stored")
    if os.environ.get("HF_TOKEN"):
        print("HF_TOKEN is set in this environment; downloads use it first")
    return 0


def run_api_token(args: argparse.Namespace) -> int:
    """A fresh token for the API server, kept in the keyring; printed so clients can be set up."""
    try:
        if args.delete:
            secrets.delete_api_token()
            print("API token removed from the OS keyring")
            return 0
        token = secrets.new_api_token()
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print(token)
    where = f"stored in the OS keyring ({_backend()})"
    print(f"{where}; clients send it as `Authorization: Bearer <token>`", file=sys.stderr)
    return 0


def run_engine_token(args: argparse.Namespace) -> int:
    """The remote engine's key (llama-server or vLLM started with --api-key), keyring only."""
    try:
        if args.delete:
            secrets.delete_engine_token()
            print("engine token removed from the OS keyring")
            return 0
        secrets.set_engine_token(read_token("remote engine token"))
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print(f"engine token stored in the OS keyring ({_backend()}); requests to [engine] url send it")
    return 0


def run_tinker_key(args: argparse.Namespace) -> int:
    try:
        secrets.set_tinker_key(read_token("Tinker API key"))
    except KeyringError as exc:
        raise _unavailable(exc) from None
    print(f"Tinker key stored in the OS keyring ({_backend()}); remote training stays off until you turn it on")
    return 0
