"""Small helpers shared by the command modules."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from macaron_local.settings import Settings


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", help="model name (default: the configured model)")


def load_settings() -> Settings:
    settings = Settings.load()
    settings.ensure_dirs()
    return settings


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, ensure_ascii=False, default=str)
    sys.stdout.write("\n")
