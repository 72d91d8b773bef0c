"""A model's protocol settings, from the `[protocol]` table of its manifest.

    [protocol]
    profile = "embedded"      # a profile shipped in the package (else the model's own files)
    default_label = "L2"      # the route when L0's output is not a label (profile files only)
    summaries = false         # skip the summary hop on machines where it costs too much
    family = "qwen3_coder"    # tool-call markup and reasoning blocks (default: from architecture)
    tool_grammar = true       # constrain replies to text or a well-formed call when tools are offered

Read straight from the manifest's TOML file, so a user can turn summaries off for one model
without touching the others.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from macaron_local.catalog import Manifest
from macaron_local.errors import InvalidInputError
from macaron_local.protocol.profile import LABELS, PROFILE_FILES, RoutingProfile, load_profile, shipped_profile

ROUTE_MAX_TOKENS = 24  # the route hop's budget, as Mind Lab serves it
SUMMARY_MAX_TOKENS = 192


@dataclass(frozen=True)
class ProtocolOptions:
    profile: str | None = None
    default_label: str = "L0"
    summaries: bool = True
    family: str = ""
    route_max_tokens: int = ROUTE_MAX_TOKENS
    summary_max_tokens: int = SUMMARY_MAX_TOKENS
    tool_grammar: bool = False


def protocol_options(manifest: Manifest) -> ProtocolOptions:
    """The manifest's `[protocol]` table (defaults when it has none)."""
    table: Mapping[str, Any] = {}
    if manifest.origin is not None and manifest.origin.is_file():
        try:
            table = tomllib.loads(manifest.origin.read_text(encoding="utf-8")).get("protocol", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise InvalidInputError(f"model manifest {manifest.origin} is unreadable: {exc}") from None
    if not isinstance(table, Mapping):
        raise InvalidInputError(f"{manifest.origin}: [protocol] must be a table")
    options = ProtocolOptions(
        profile=table.get("profile"),
        default_label=str(table.get("default_label", "L0")),
        summaries=bool(table.get("summaries", True)),
        family=str(table.get("family", "")),
        route_max_tokens=int(table.get("route_max_tokens", ROUTE_MAX_TOKENS)),
        summary_max_tokens=int(table.get("summary_max_tokens", SUMMARY_MAX_TOKENS)),
        tool_grammar=bool(table.get("tool_grammar", False)),
    )
    if options.default_label not in LABELS:
        raise InvalidInputError(f"{manifest.origin}: default_label must be one of {', '.join(LABELS)}")
    return options


def resolve_profile(manifest: Manifest, files: Mapping[str, Path] | None = None) -> RoutingProfile:
    """The model's routing profile: its own downloaded files when `files` names them (route,
    lora, intro, summary: the catalog's paths for a pulled model), else the shipped profile
    the manifest names, else the embedded model's (written generally enough for any base)."""
    options = protocol_options(manifest)
    if files and all(part in files for part in PROFILE_FILES):
        return load_profile(
            *(files[part] for part in PROFILE_FILES),
            default_label=options.default_label,
            model_name=manifest.name,
            name=manifest.name,
        )
    return shipped_profile(options.profile or "embedded")
