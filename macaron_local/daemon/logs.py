"""The daemon's log: `daemon.log` in the platformdirs log directory, rotated, private.

A scheduled run has no terminal, so this file is where "why did it not learn last night?" is
answered. It is 0600 like everything else of the user's, rotates at 1 MB keeping five old
files, and a filter masks anything shaped like a Hugging Face token, so a secret that slips
into an exception message still never reaches the disk.
"""

from __future__ import annotations

import logging
import os
import re
from logging.handlers import RotatingFileHandler
from pathlib import Path

from macaron_local.settings import Settings

LOGGER_NAME = "macaron_local.daemon"
LOG_FILENAME = "daemon.log"
MAX_BYTES = 1_000_000
BACKUPS = 5
TOKEN_PATTERN = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
REDACTED = "hf_***"


def redact(text: str) -> str:
    return TOKEN_PATTERN.sub(REDACTED, text)


class RedactSecrets(logging.Filter):
    """Mask token-shaped strings in the formatted message (and exception text) of each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = None
        record.msg, record.args = redact(message), None
        return True


class PrivateRotatingFileHandler(RotatingFileHandler):
    """A RotatingFileHandler whose files are created 0600, whatever the umask."""

    def _open(self):  # type: ignore[override]
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.chmod(self.baseFilename, 0o600)
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8")


def log_path(settings: Settings) -> Path:
    return settings.log_dir / LOG_FILENAME


def daemon_logger(settings: Settings) -> logging.Logger:
    """The daemon's logger, writing to `log_path(settings)` (set up once per file)."""
    settings.ensure_dirs()
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    target = str(log_path(settings))
    for handler in list(logger.handlers):
        if getattr(handler, "baseFilename", None) != target:
            logger.removeHandler(handler)
            handler.close()
    if not logger.handlers:
        handler = PrivateRotatingFileHandler(target, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s pid=%(process)d %(levelname)s %(message)s"))
        handler.addFilter(RedactSecrets())
        logger.addHandler(handler)
    return logger
