"""Which copies of the base the nightly run may hold at once, decided before it starts.

A night needs two programs over the same base: llama.cpp (rollouts, the gate, parity) and the
trainer (its own copy: dequantized, MLX 4-bit or NF4). On Tall each is about 20 GB or more, and
the chat app, when open, holds its own llama.cpp copy too. The plan is pure arithmetic on figures
the caller passes in (measured or from the published shapes), so tests inject any machine:

- `together`: engine + trainer (+ the open app's engine) fit: the run as it is today.
- `sequential`: they do not all fit, but the larger of the two phases does: rollouts through
  llama.cpp first, then the engine closed while the trainer steps, then the trainer freed before
  the engine comes back for parity and the gate.
- `wait`: not even one phase fits beside an open chat app. The app is never killed: the daemon
  waits for it to close (its condition says so), and a machine too small even without the app
  cannot learn this model locally (`too_small`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
#: Kept free for the OS and other programs (a planning allowance, not a measurement).
OS_RESERVE_BYTES = 6 * GIB


@dataclass(frozen=True)
class Footprint:
    """Peak bytes of each part of a night on one machine."""

    engine_bytes: int  # the run's llama.cpp: base (mmapped, resident once touched) + experts + KV
    trainer_bytes: int  # trainer base + stacked expert + personal LoRA + optimizer + activations
    app_bytes: int = 0  # an open chat app's own engine (0 when the app is closed)


@dataclass(frozen=True)
class MemoryPlan:
    mode: str  # together | sequential | wait | too_small
    peak_bytes: int
    budget_bytes: int
    reason: str

    @property
    def can_run(self) -> bool:
        return self.mode in ("together", "sequential")

    @property
    def close_engine_while_training(self) -> bool:
        return self.mode == "sequential"


def plan_memory(footprint: Footprint, total_bytes: int, reserve_bytes: int = OS_RESERVE_BYTES) -> MemoryPlan:
    """The largest plan that fits `total_bytes` of RAM (unified memory on a Mac) less `reserve_bytes`."""
    budget = total_bytes - reserve_bytes
    e, t, app = footprint.engine_bytes, footprint.trainer_bytes, footprint.app_bytes

    def gib(n: int) -> str:
        return f"{n / GIB:.1f} GiB"

    together = e + t + app
    if together <= budget:
        fits = f"engine and trainer fit together ({gib(together)} of {gib(budget)})"
        return MemoryPlan("together", together, budget, fits)
    sequential = max(e, t) + app
    if sequential <= budget:
        return MemoryPlan(
            "sequential",
            sequential,
            budget,
            f"engine + trainer need {gib(together)} of {gib(budget)}: rollouts first, "
            f"then the engine is closed while the trainer steps (peak {gib(sequential)})",
        )
    if app and max(e, t) <= budget:
        return MemoryPlan(
            "wait",
            sequential,
            budget,
            f"the open chat app holds {gib(app)}; learning waits for it to close "
            f"(needs {gib(sequential)} of {gib(budget)} with it open)",
        )
    return MemoryPlan(
        "too_small",
        max(e, t),
        budget,
        f"one phase alone needs {gib(max(e, t))} of {gib(budget)}: this machine cannot learn this model "
        "locally (a smaller model, or a remote trainer)",
    )


def trainer_bytes_estimate(checkpoint_bytes: int, expert_bytes: int, backend: str, quantization: str | None) -> int:
    """A planning figure for the trainer's peak: its copy of the base (float32 on a CPU torch,
    the chosen bitsandbytes width on CUDA, 4-bit on MLX), the stacked expert in float32, and a
    fixed allowance for activations, the personal LoRA and its optimizer."""
    from macaron_local.learn.backends.checkpoint import BITS_FACTOR

    if backend == "mlx":
        base = checkpoint_bytes * BITS_FACTOR["4bit"]
    elif quantization is None and backend == "torch-cpu":
        base = checkpoint_bytes * 2  # BF16 on disk, float32 in the trainer
    else:
        base = checkpoint_bytes * BITS_FACTOR[quantization]
    return int(base + 2 * expert_bytes + 2 * GIB)


def machine_memory_plan(settings, total_bytes: int | None = None, app_bytes: int | None = None) -> MemoryPlan | None:
    """The plan for the active model on this machine, for models whose trainer stacks its
    experts from a trainer checkpoint (Tall); None for the others (small models always fit) or
    when a figure is unknown. The daemon's `memory` condition reads it.

    `app_bytes` None: an open chat app (any open session, seen through its shared lock in the
    data dir) is counted as one more engine of the same model, 0 when none is open."""
    from macaron_local.catalog import SLOTS, Catalog
    from macaron_local.daemon.locks import chat_app_open
    from macaron_local.fit import RUNTIME_OVERHEAD_BYTES, machine_ram_bytes
    from macaron_local.learn.backends import choose_backend
    from macaron_local.learn.backends.checkpoint import checkpoint_bytes, resolve_checkpoint
    from macaron_local.learn.stacking import expert_trainer_source

    catalog = Catalog(settings)
    try:
        manifest = catalog.default()
        if manifest.architecture != "qwen35moe" or not manifest.trainer_checkpoint:
            return None
        checkpoint = resolve_checkpoint(catalog.trainer_checkpoint(manifest) or manifest.trainer_checkpoint)
        base_path = catalog.base_path(manifest)
        backend = choose_backend(str(settings.get("learning_backend") or "auto"))
    except Exception:  # noqa: BLE001  (no plan: the other conditions decide, the run reports errors)
        return None
    experts = [catalog.expert_path(manifest, slot) for slot in SLOTS]
    expert_files = [p.stat().st_size for p in experts if p is not None and p.is_file()]
    sources = [expert_trainer_source(catalog, manifest, slot) for slot in SLOTS]
    peft = [checkpoint_bytes(s) for s in sources if s is not None]
    engine = base_path.stat().st_size + max(expert_files, default=0) + RUNTIME_OVERHEAD_BYTES
    trainer = trainer_bytes_estimate(
        checkpoint_bytes(checkpoint), max(peft, default=0), "mlx" if backend == "mlx" else "torch-cpu", None
    )
    total = total_bytes if total_bytes is not None else machine_ram_bytes()
    if total is None:
        return None
    if app_bytes is None:
        app_bytes = engine if chat_app_open(settings) else 0
    return plan_memory(Footprint(engine, trainer, app_bytes), total)


def nightly_mode(settings) -> str:
    """How `learn.run` holds the base tonight: `together` (engine and trainer open side by
    side) unless this machine's plan says they cannot both be resident, then `sequential`
    (also the smaller plan when the daemon's condition was bypassed, e.g. `macaron learn`)."""
    plan = machine_memory_plan(settings)
    return "together" if plan is None or plan.mode == "together" else "sequential"
