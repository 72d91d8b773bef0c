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
