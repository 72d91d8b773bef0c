"""Small helpers shared by the command modules."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from macaron_local.errors import InvalidInputError, MacaronError
from macaron_local.settings import Settings


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="model name (default: the configured model)")


def load_settings(*, readonly: bool = False) -> Settings:
    """The user's settings, folders created 0700. A command that only reads (`readonly`) goes on
    when they cannot be created or tightened (a read-only mount): what it reads says so."""
    settings = Settings.load()
    try:
        settings.ensure_dirs()
    except InvalidInputError:
        raise  # a file where a folder must be: nothing can be read there either
    except MacaronError:
        if not readonly:
            raise
    return settings


#: JSON escapes C0 controls itself; DEL and the C1 range (0x9b is CSI in some terminals) too.
_RAW_CONTROLS = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def print_json(data: Any) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    sys.stdout.write(_RAW_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n")
