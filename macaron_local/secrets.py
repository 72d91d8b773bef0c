"""Secrets (a Hugging Face token) live in the OS keyring, never in a file or a log."""

from __future__ import annotations

import contextlib
import os

import keyring
from keyring.errors import KeyringError, PasswordDeleteError

SERVICE = "macaron-local"
HF_TOKEN_KEY = "huggingface-token"


def get_hf_token() -> str | None:
    """The token for gated downloads: `HF_TOKEN` if set, else the keyring, else None."""
    if token := os.environ.get("HF_TOKEN"):
        return token
    try:
        return keyring.get_password(SERVICE, HF_TOKEN_KEY)
    except KeyringError:
        return None  # no usable keyring backend: anonymous downloads still work


def set_hf_token(token: str) -> None:
    keyring.set_password(SERVICE, HF_TOKEN_KEY, token)


def delete_hf_token() -> None:
    with contextlib.suppress(PasswordDeleteError):
        keyring.delete_password(SERVICE, HF_TOKEN_KEY)


API_TOKEN_KEY = "api-token"


def get_api_token() -> str | None:
    """The bearer token `macaron serve` requires off loopback (None when none is stored)."""
    try:
        return keyring.get_password(SERVICE, API_TOKEN_KEY)
    except KeyringError:
        return None


def new_api_token() -> str:
    """Make, store and return a fresh API token (the previous one stops working)."""
    import secrets as random

    token = "mk-" + random.token_urlsafe(32)
    keyring.set_password(SERVICE, API_TOKEN_KEY, token)
    return token


def delete_api_token() -> None:
    with contextlib.suppress(PasswordDeleteError):
        keyring.delete_password(SERVICE, API_TOKEN_KEY)


ENGINE_TOKEN_KEY = "engine-token"


def get_engine_token() -> str | None:
    """The bearer token a remote engine (llama-server --api-key, vLLM --api-key) wants."""
    try:
        return keyring.get_password(SERVICE, ENGINE_TOKEN_KEY)
    except KeyringError:
        return None


def set_engine_token(token: str) -> None:
    keyring.set_password(SERVICE, ENGINE_TOKEN_KEY, token)


def delete_engine_token() -> None:
    with contextlib.suppress(PasswordDeleteError):
        keyring.delete_password(SERVICE, ENGINE_TOKEN_KEY)


TINKER_KEY = "tinker-api-key"


def get_tinker_key() -> str | None:
    """The Tinker (or MinT) API key for the remote trainer; TINKER_API_KEY takes precedence."""
    if key := os.environ.get("TINKER_API_KEY"):
        return key
    try:
        return keyring.get_password(SERVICE, TINKER_KEY)
    except KeyringError:
        return None


def set_tinker_key(key: str) -> None:
    keyring.set_password(SERVICE, TINKER_KEY, key)
