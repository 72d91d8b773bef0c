"""Errors that front ends turn into one clear line and an exit code.

Every failure a user can cause (a bad file, a missing model, a full disk) is raised as a
`MacaronError`, so the CLI prints `error: <message>` and exits with `exit_code` instead of a
traceback. Bugs stay ordinary exceptions.
"""

from __future__ import annotations


class MacaronError(Exception):
    """A user-facing failure: its message is one line that says what is wrong."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class InvalidInputError(MacaronError):
    """The user handed us something malformed (a file, an argument)."""

    exit_code = 2


class AdapterError(InvalidInputError):
    """An adapter file is not a LoRA adapter llama.cpp can safely load for this base model."""


class ModelError(MacaronError):
    """A model is missing, unreadable, or not what its manifest promised."""


class DownloadError(MacaronError):
    """A model download could not start or finish."""
