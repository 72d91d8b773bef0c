"""A routing profile: the texts that make a model's experts behave as they were trained to.

A profile is four files (the layout Mind Lab publishes for Macaron-V1-Tall):
- `route.md`: the route instruction. `{{LORA_DESCRIPTIONS}}` becomes one `Lx = description`
  line per expert and `{{ROUTE_LABELS}}` the labels; a trailing `model_id=` stem is the
  assistant prefill, not part of the user message.
- `lora.md`: the expert descriptions, one `## Lx` section each with `adapter_name:` and a
  `### Description` block.
- `intro.md`: the identity instruction every answer hop's system message carries.
- `summary.md`: the instruction of the hidden summary hop.
`{{MODEL_NAME}}` and `{{BASE_MODEL}}` are filled in everywhere. The embedded model ships a
profile of its own (`profiles/embedded/`); Tall's comes with its download, pinned and hashed,
and is loaded from the paths the catalog gives.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from macaron_local.errors import InvalidInputError

PREFILL = "model_id="
LABELS = ("L0", "L1", "L2", "L3")
PROFILE_FILES = ("route", "lora", "intro", "summary")
SHIPPED_DIR = Path(__file__).parent / "profiles"

#: How another expert's finished task reads in an expert's own view when no handoff text is
#: given: the summary as a prior assistant message (our own wording).
DEFAULT_HANDOFF = "(Another expert handled this request. What it did: {summary})"

_SECTION = re.compile(r"^##\s+(L\d+)\s*$", re.IGNORECASE)
_ADAPTER = re.compile(r"^adapter_name:\s*(\S+)\s*$")


@dataclass(frozen=True)
class RoutingProfile:
    """Everything the three hops need besides the conversation itself."""

    name: str
    route_template: str  # with {{LORA_DESCRIPTIONS}} / {{ROUTE_LABELS}}, prefill stem removed
    descriptions: dict[str, str]  # label -> description (one line once rendered)
    intro: str
    summary_instruction: str
    default_label: str
    handoff: str = DEFAULT_HANDOFF

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(sorted(self.descriptions))

    @property
    def route_instruction(self) -> str:
        """The instruction that follows the raw request in the route hop's user message."""
        lines = "\n".join(f"{label} = {' '.join(self.descriptions[label].split())}" for label in self.labels)
        return (
            self.route_template.replace("{{LORA_DESCRIPTIONS}}", lines)
            .replace("{{ROUTE_LABELS}}", " ".join(self.labels))
            .strip()
        )

    def handoff_text(self, summary: str) -> str:
        return self.handoff.replace("{summary}", summary.strip())


def parse_descriptions(text: str, where: str) -> dict[str, str]:
    """`## Lx` sections of a `lora.md`: each needs `adapter_name:` and a `### Description`."""
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        match = _SECTION.fullmatch(line.strip())
        if match:
            current = match.group(1).upper()
            if current in sections:
                raise InvalidInputError(f"{where}: expert {current} is described twice")
            sections[current] = []
        elif current is not None:
            sections[current].append(line.rstrip())
    if not sections:
        raise InvalidInputError(f"{where}: no expert sections (expected headings like '## L0')")
    descriptions = {}
    for label, lines in sections.items():
        adapter, body, inside = "", [], False
        for line in lines:
            stripped = line.strip()
            if not inside and _ADAPTER.fullmatch(stripped):
                adapter = _ADAPTER.fullmatch(stripped).group(1)  # type: ignore[union-attr]
            elif stripped == "### Description":
                inside = True
            elif stripped.startswith("### ") and inside:
                inside = False
            elif inside:
                body.append(line)
        description = "\n".join(body).strip()
        if not adapter or not description:
            raise InvalidInputError(f"{where}: expert {label} needs adapter_name and a Description")
        descriptions[label] = description
    if tuple(sorted(descriptions)) != LABELS:
        raise InvalidInputError(f"{where}: must describe exactly {', '.join(LABELS)}")
    return descriptions


def _read(path: Path, model_name: str, base_model: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"routing profile file {path} is unreadable: {exc}") from None
    if not text:
        raise InvalidInputError(f"routing profile file {path} is empty")
    return text.replace("{{MODEL_NAME}}", model_name).replace("{{BASE_MODEL}}", base_model)


def load_profile(
    route: Path,
    lora: Path,
    intro: Path,
    summary: Path,
    *,
    default_label: str,
    model_name: str,
    base_model: str = "",
    handoff: Path | None = None,
    name: str = "",
) -> RoutingProfile:
    """Load a profile from its files (a clear InvalidInputError for a bad one)."""
    template = _read(route, model_name, base_model)
    for token in ("{{LORA_DESCRIPTIONS}}", "{{ROUTE_LABELS}}"):
        if token not in template:
            raise InvalidInputError(f"{route} must contain {token}")
    stripped = template.rstrip()
    if stripped.endswith(PREFILL):  # the stem is the assistant prefill, not the user's text
        template = stripped[: -len(PREFILL)].rstrip()
    if default_label not in LABELS:
        raise InvalidInputError(f"default label {default_label!r} is not one of {', '.join(LABELS)}")
    return RoutingProfile(
        name=name or model_name,
        route_template=template,
        descriptions=parse_descriptions(_read(lora, model_name, base_model), str(lora)),
        intro=_read(intro, model_name, base_model),
        summary_instruction=_read(summary, model_name, base_model),
        default_label=default_label,
        handoff=_read(handoff, model_name, base_model) if handoff is not None else DEFAULT_HANDOFF,
    )


def shipped_profile(name: str) -> RoutingProfile:
    """A profile that ships inside the package (`profiles/<name>/`, with a `profile.toml`
    naming its model, base model and default label)."""
    folder = SHIPPED_DIR / name
    meta_path = folder / "profile.toml"
    if not meta_path.is_file():
        raise InvalidInputError(f"no routing profile named {name!r} ships with macaron-local")
    meta = tomllib.loads(meta_path.read_text(encoding="utf-8"))
    handoff = folder / "handoff.md"
    return load_profile(
        *(folder / f"{part}.md" for part in PROFILE_FILES),
        default_label=meta.get("default_label", "L0"),
        model_name=meta.get("model_name", name),
        base_model=meta.get("base_model", ""),
        handoff=handoff if handoff.is_file() else None,
        name=name,
    )
