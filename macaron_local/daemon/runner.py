"""One `macaron daemon run`: take the lock, check the conditions, learn or say why not, record.

Everything it decides goes to the daemon log (a scheduled run has no terminal) and to the run
history that `daemon status` and the app show. Learning itself is `learn_once`, the same pass
`macaron learn` makes, configured by the `[learn]` settings table. Priority is lowered by the
command, not here, so tests can call `run_once` without renicing themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from macaron_local.catalog import Catalog
from macaron_local.daemon import history
from macaron_local.daemon.conditions import Probes, check
from macaron_local.daemon.config import daemon_config, learn_config
from macaron_local.daemon.history import DaemonRun
from macaron_local.daemon.locks import single_instance
from macaron_local.daemon.logs import daemon_logger, log_path
from macaron_local.errors import MacaronError
from macaron_local.settings import Settings
from macaron_local.store import open_default_store

LOCK_HELD = "another learning run is in progress (it holds the daemon lock)"
TRAINER_PACKAGES = ("torch", "transformers", "peft", "mlx", "mlx_lm")


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run_once(
    settings: Settings,
    *,
    skip_window: bool = False,
    probe: Probes | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> DaemonRun:
    """Learn if every condition holds; return (and record) what happened.

    A run that did not learn is a normal outcome ("skipped", with reasons), not an error. A
    learning pass that fails is recorded as "failed" and raised as a one-line MacaronError.
    """
    logger = daemon_logger(settings)
    started, clock = _now_iso(), time.perf_counter()

    def say(line: str) -> None:
        logger.info(line)
        if on_progress is not None:
            on_progress(line)

    def finish(outcome: str, reasons: list[str], slots: list[dict] | None = None) -> DaemonRun:
        run = DaemonRun(
            started_at=started,
            finished_at=_now_iso(),
            outcome=outcome,
            reasons=reasons,
            slots=slots or [],
            forced=skip_window,
            wall_s=round(time.perf_counter() - clock, 1),
        )
        history.record(settings, run)
        return run

    logger.info("daemon run started%s", " (--now: window not checked)" if skip_window else "")
    try:
        config, learning = daemon_config(settings), learn_config(settings)
    except MacaronError as exc:
        logger.error("bad settings: %s", exc)
        finish("failed", [str(exc)])
        raise
    with single_instance(settings) as acquired:
        if not acquired:
            say(f"not learning: {LOCK_HELD}")
            return finish("skipped", [LOCK_HELD])
        with open_default_store(settings) as store:
            verdict = check(settings, config, store, probe, skip_window=skip_window)
            for item in verdict.checks:
                logger.info("condition %s: %s (%s)", item.name, "ok" if item.ok else "NOT MET", item.detail)
            if not verdict.ok:
                say("not learning: " + "; ".join(verdict.reasons))
                return finish("skipped", verdict.reasons)
            try:
                catalog = Catalog(settings)
                manifest = catalog.default()
                say(f"learning on {manifest.name} ({learning.steps} steps per expert)")
                stop = _interrupter(settings, probe or Probes(), say)
                reports = _learn(store, catalog, manifest, learning, say, stop)
            except MacaronError as exc:
                logger.error("learning failed: %s", exc)
                finish("failed", [str(exc)])
                raise
            except Exception as exc:
                logger.exception("learning failed")
                finish("failed", [f"{type(exc).__name__}: {exc}"])
                raise MacaronError(f"learning failed ({type(exc).__name__}: {exc}); see {log_path(settings)}") from exc
    slots = [{"slot": r.slot, "decision": r.decision, "version_id": r.version_id, "reason": r.reason} for r in reports]
    for item in slots:
        version = f" as {item['version_id']}" if item["version_id"] else ""
        say(f"{item['slot']}: {item['decision']}{version}: {item['reason']}")
    if not slots:
        say("nothing to learn: no expert had feedback to train on")
    return finish("learned", [], slots)


def _interrupter(settings: Settings, probe: Probes, say: Callable[[str], None]) -> Callable[[], bool]:
    """Polled between training steps: a chat that starts streaming or a machine that goes on
    battery stops the run (the user comes first); the feedback waits for the next night."""

    def should_stop() -> bool:
        if probe.generating(settings):
            say("stopping: a chat started generating")
            return True
        if probe.on_ac() is False:
            say("stopping: the machine is on battery")
            return True
        return False

    return should_stop


def _learn(store, catalog, manifest, learning, say, should_stop: Callable[[], bool]):
    from macaron_local.learn.run import learn_once

    def step(log) -> None:
        figures = f"loss {log.loss:.3f} kl {log.kl:.3f} reward {log.reward_mean:+.3f}"
        say(f"  step {log.step + 1}/{log.total or learning.steps} {figures}")

    try:
        return learn_once(store, catalog, manifest, learning, on_step=step, should_stop=should_stop)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in TRAINER_PACKAGES:
            raise MacaronError(
                f"learning needs {exc.name}, which is not installed: pip install 'macaron-local[torch]'"
            ) from None
        raise
