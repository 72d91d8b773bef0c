"""Health checks behind `macaron doctor`: is everything needed to chat here and sound?"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import stat
import sys
from dataclasses import dataclass

from macaron_local import __version__
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.catalog import SLOTS, Catalog, Manifest
from macaron_local.errors import MacaronError
from macaron_local.settings import Settings


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_checks(settings: Settings, model: str | None = None, load: bool = False) -> list[Check]:
    """Every check, in order; a failed check never stops the others."""
    checks = [
        Check("macaron-local", True, __version__),
        Check("python", sys.version_info >= (3, 11), f"{platform.python_version()} on {platform.platform()}"),
    ]
    for package in ("llama-cpp-python", "gguf", "numpy", "textual", "sqlite-utils"):
        version = _version(package)
        checks.append(Check(package, version != "not installed", version))
    checks.append(_backend_check())
    checks.extend(_path_checks(settings))
    checks.append(_settings_check(settings))
    checks.append(_tools_check(settings))
    checks.append(_engine_check(settings))

    catalog = Catalog(settings)
    try:
        manifest = catalog.get(model) if model else catalog.default()
    except MacaronError as exc:
        return [*checks, Check("model", False, str(exc))]
    checks.extend(verify_model(catalog, manifest))
    checks.append(_tall_fit_check(settings, serving_tall=manifest.name == "tall"))

    if load:
        checks.append(_load_check(settings, manifest.name))
    return checks


def verify_model(catalog: Catalog, manifest: Manifest, check_hash: bool = False) -> list[Check]:
    """The base GGUF is present and parses (and matches its sha256 with `check_hash`); every
    expert adapter validates against it."""
    base_path = catalog.base_path(manifest)
    try:
        base = BaseModelInfo.from_gguf(base_path)
        if check_hash and manifest.base.sha256:
            from macaron_local.download import verify_sha256

            verify_sha256(base_path, manifest.base.sha256)
    except MacaronError as exc:
        return [Check("model", False, f"{manifest.name}: {exc}")]
    checks = [Check("model", True, f"{manifest.name}: {base.name} ({base.architecture}) at {base_path}")]
    for slot, label in SLOTS.items():
        path = catalog.expert_path(manifest, slot)
        if path is None:
            checks.append(Check(f"expert {slot} {label}", True, "served by the base model"))
            continue
        try:
            report = validate_adapter(path, base)
            checks.append(Check(f"expert {slot} {label}", True, f"{path.name}: {report.summary()}"))
        except MacaronError as exc:
            checks.append(Check(f"expert {slot} {label}", False, str(exc)))
    return checks


def _tall_fit_check(settings: Settings, serving_tall: bool) -> Check:
    """Whether this machine can run Tall, with the numbers; a failure only when Tall is the model."""
    from macaron_local.fit import machine_verdict

    fits, line = machine_verdict(settings.models_dir)
    return Check("tall fit", fits or not serving_tall, line)


def _backend_check() -> Check:
    try:
        import llama_cpp

        from macaron_local.engine.llama_load import extra_buffers_allowed

        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
        features = " ".join(part for part in info.split("|") if "= 1" in part).replace(" = 1", "")
        buffers = "" if extra_buffers_allowed() else "weight repacking off (AMX CPU: llama.cpp's AMX path crashes); "
        offload = "with" if gpu else "without"
        return Check("backend", True, f"llama.cpp {offload} GPU offload; {buffers}{features[:120]}")
    except Exception as exc:  # a broken native build must be reported, not crash doctor
        return Check("backend", False, f"llama.cpp failed to load: {exc}")


def _path_checks(settings: Settings) -> list[Check]:
    checks = []
    for label, path in (("data dir", settings.data_dir), ("config dir", settings.config_dir)):
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError as exc:
            checks.append(Check(label, False, f"{path}: {exc.strerror}"))
            continue
        writable = os.access(path, os.W_OK)
        private = mode & 0o077 == 0
        ok = writable and private
        why = "" if ok else (" (not writable)" if not writable else f" (mode {mode:o}; should be 700)")
        checks.append(Check(label, ok, f"{path}{why}"))
    return checks


def _tools_check(settings: Settings) -> Check:
    """What the agent may touch: offered or not, the writable folders, MCP servers, and whether
    commands run without network here."""
    from macaron_local.tools.builtin import command_has_network
    from macaron_local.tools.config import tools_config

    try:
        config = tools_config(settings.values.get("tools"))
    except MacaronError as exc:
        return Check("tools", False, str(exc))
    writable = ", ".join(str(f) for f in config.write_folders) or "none"
    network = "commands can reach the network" if command_has_network() else "commands run without network"
    servers = f"; MCP: {', '.join(s.name for s in config.mcp)}" if config.mcp else ""
    state = "offered" if config.enabled else "off (settings [tools] enabled = true)"
    return Check("tools", True, f"{state}; writable: {writable}; {network}{servers}")


def _engine_check(settings: Settings) -> Check:
    """Which engine runs the model; a configured server is not contacted (doctor stays offline)."""
    from macaron_local.engine.remote.config import engine_config

    try:
        config = engine_config(settings.values.get("engine"))
    except MacaronError as exc:
        return Check("engine", False, str(exc))
    return Check("engine", True, config.describe())


def _settings_check(settings: Settings) -> Check:
    """The settings file passed its schema when it was loaded; keys it does not know are named."""
    from macaron_local.settings import DEFAULTS
    from macaron_local.settings_schema import unknown_keys

    values = settings.configured()
    unknown = unknown_keys(values, DEFAULTS)
    note = f"; unknown keys, kept but unused: {', '.join(unknown)}" if unknown else ""
    return Check("settings", True, f"{settings.settings_file}: {len(values)} key(s) checked{note}")


def _load_check(settings: Settings, model: str) -> Check:
    from macaron_local.engine import GenerationParams
    from macaron_local.session import Session

    try:
        with Session(settings, model=model) as session:
            reply = session.send("Say OK.", params=GenerationParams(max_tokens=4)).wait()
        return Check("generation", True, f"model loaded and answered ({len(reply.completion.tokens)} tokens)")
    except MacaronError as exc:
        return Check("generation", False, str(exc))


def learning_section(settings: Settings) -> dict:
    """`doctor`'s learning section: the trainer and its device (imported in a child process),
    the schedule, the next window, the feedback waiting, and what that means right now."""
    from macaron_local.learning_setup import LearningSetup
    from macaron_local.store import open_default_store

    setup = LearningSetup(settings)
    try:
        with open_default_store(settings) as store:
            status = setup.readiness(store)
    except MacaronError as exc:
        return {"error": str(exc)}
    device = setup.device() if status.trainer else None
    return {
        "state": status.state,
        "trainer": status.trainer,
        "device": device.device if device is not None and device.ok else None,
        "trainer_detail": device.detail if device is not None else _no_trainer(status.trainer_plan),
        "schedule_installed": status.schedule_installed,
        "schedule_state": status.schedule_state,
        "schedule_files": status.schedule_files,
        "window": status.window,
        "next_window": status.next_start,
        "next_window_text": status.next_start_text,
        "feedback_waiting": status.pending_feedback,
        "min_feedback": status.min_feedback,
        "paused": status.paused,
        "choice": status.choice,
        "summary": status.sentence(),
        "action": status.action_cli,
    }


def _no_trainer(plan: str | None) -> str:
    if plan is None or plan.startswith("No trainer can be installed"):
        return f"none installed. {plan or ''}".strip()
    return f"none installed; `macaron setup` would install {plan}"


def learning_lines(section: dict) -> list[str]:
    """The learning section as `doctor` prints it."""
    if "error" in section:
        return ["learning:", f"  error             {section['error']}"]
    schedule = (
        f"installed ({section['schedule_state']}): {', '.join(section['schedule_files'])}"
        if section["schedule_installed"]
        else "not installed"
    )
    rows = [
        ("trainer", section["trainer_detail"]),
        ("schedule", schedule),
        ("next window", f"{section['next_window_text']} ({section['next_window']}, window {section['window']})"),
        ("feedback waiting", f"{section['feedback_waiting']} (a nightly run needs {section['min_feedback']})"),
        ("status", " ".join(p for p in (section["summary"], section["action"]) if p)),
    ]
    return ["learning:", *(f"  {name:<16}  {value}" for name, value in rows)]
