"""Learning benchmark: does the model move toward a simulated user's corrections without
forgetting, compared with the usual approaches measured in the same run?

For a scenario file (name, check {type: regex, pattern, flags}, train [{prompt, correction}],
heldout [prompt]):
1. seed a fresh store (MACARON_HOME in a temp dir) with chats whose replies the model generated
   (each prompt routed to its expert as the chat routes it) and the user corrected as the
   scenario says (`--ratings-only`: the user never writes a correction; it rates each reply,
   +1 when the check passes, -1 when not, and regenerates it twice in the same conversation,
   rating each new answer);
2. run exactly the pass `macaron learn` runs (`learn_once` with the settings' `[learn]`
   config; flags override, and `config` in the JSON records what was used);
3. score held-out prompts (greedy replies, each routed and served with what the chat would
   stack on its expert, pass the scenario's check) and the regression set (passage NLL, factual
   QA with the chat's system prompt and template), before and after;
4. the same for plain supervised LoRA (the usual approach) and for pasting the corrections
   into the system prompt (prompt memory, with its time to first token);
5. trainer tokens/s against a plain peft/transformers loop on the same model and batch.

`after` and the regression figures are measured with whatever the run deployed (nothing, if the
gate rejected every candidate); `deployed`, `decision_reason` and `slots` (one entry per slot
the run decided on, with its candidates) say which. `home` is the store's folder, kept for
bench/candidates.py and bench/stacked.py.

Usage: python bench/learning.py --scenario ../shared/scenarios/tldr.json --json
       python bench/learning.py --model tiny-qwen35moe --scenario ... --json   (Tall's code path:
       a tiny random qwen3_5_moe with PEFT experts and a trainer checkpoint, see tiny_tall.py;
       `--model DIR` takes a directory that script built)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from common import emit

from macaron_local.adapters import BaseModelInfo
from macaron_local.daemon.config import learn_config
from macaron_local.engine import Engine, GenerationParams
from macaron_local.errors import MacaronError
from macaron_local.learn import losses
from macaron_local.learn.backends import choose_backend
from macaron_local.learn.backends.base import make_batch
from macaron_local.learn.backends.torch_backend import TorchBackend
from macaron_local.learn.episodes import episodes_from_store
from macaron_local.learn.export import export_gguf
from macaron_local.learn.loop import completion_tokens
from macaron_local.learn.regression import score as regression_score
from macaron_local.learn.run import learn_once, serve_params
from macaron_local.session import Session
from macaron_local.settings import Settings

GREEDY = GenerationParams(max_tokens=48, temperature=0.0, repeat_penalty=1.1)
RATINGS_PER_PROMPT = 3


def load_scenario(path: Path, corrections: bool = True) -> dict:
    """The scenario at `path`, checked whole before any model loads: a malformed file is one
    line on stderr and exit 1, never a traceback an hour into a run. Its name is the file's stem
    unless it names itself. `corrections`: every train item must carry one (False where only
    ratings or the held-out prompts are used, so a ratings-only file may leave them out)."""
    try:
        scenario = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: scenario {path} is unreadable: {exc}") from None
    if not isinstance(scenario, dict):
        raise SystemExit(f"error: scenario {path} is not a JSON object")
    problem = _scenario_problem(scenario, corrections)
    if problem:
        raise SystemExit(f"error: scenario {path}: {problem}")
    scenario.setdefault("name", path.stem)
    return scenario


def _scenario_problem(scenario: dict, corrections: bool) -> str | None:
    """What makes `scenario` unusable, or None."""
    for key in ("check", "train", "heldout"):
        if key not in scenario:
            return f"no {key!r}"
    check = scenario["check"]
    if not isinstance(check, dict) or check.get("type") != "regex":
        return "only regex checks are supported"
    if not isinstance(check.get("pattern"), str):
        return "the check has no pattern"
    flags = check.get("flags", "")
    if not isinstance(flags, str) or set(flags) - set(REGEX_FLAGS):
        return f"the check's flags {flags!r} are not some of {''.join(REGEX_FLAGS)!r}"
    try:
        checker(scenario)
    except re.error as exc:
        return f"the check's pattern does not compile: {exc}"
    train = scenario["train"]
    if not isinstance(train, list) or not train:
        return "'train' is not a non-empty list"
    for i, item in enumerate(train):
        if not (isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"].strip()):
            return f"train[{i}] has no prompt"
        correction = item.get("correction")
        if (corrections or correction is not None) and not (isinstance(correction, str) and correction.strip()):
            return f"train[{i}] has no correction" if correction is None else f"train[{i}]'s correction is not text"
    heldout = scenario["heldout"]
    if not isinstance(heldout, list) or not heldout or not all(isinstance(p, str) and p.strip() for p in heldout):
        return "'heldout' is not a non-empty list of prompts"
    if "name" in scenario and not (isinstance(scenario["name"], str) and scenario["name"].strip()):
        return "its name is not text"
    return None


REGEX_FLAGS = {"i": re.I, "m": re.M, "s": re.S, "x": re.X}


def checker(scenario: dict):
    flags = 0
    for letter in scenario["check"].get("flags", ""):
        flags |= REGEX_FLAGS[letter]
    pattern = re.compile(scenario["check"]["pattern"], flags)
    return lambda text: bool(pattern.search(text))


def served_stack(session: Session):
    """slot -> the adapters the chat stacks for a turn routed to it (expert + personal)."""
    return session.adapters_for


def bare_stack(session: Session, adapter=None):
    """slot -> the routed expert alone (no personal adapter), then `adapter` where one is given:
    the bare experts a benchmark compares with, or a candidate served in place of what is deployed."""
    experts_only = session._experts.get  # noqa: SLF001

    return lambda slot: [h for h in (experts_only(slot), adapter) if h is not None]


def heldout_share(session: Session, stack, system_prompt: str, prompts: list[str], check) -> tuple[float, float]:
    """Share of held-out prompts whose greedy reply passes the check, and the median TTFT (ms).
    Each prompt is routed as the chat routes it and answered under `stack(slot)`."""
    engine = session.engine
    passed, ttfts = 0, []
    for prompt in prompts:
        engine.set_adapters(stack(session.route(prompt).slot))
        tokens = engine.render_tokens(
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
        )
        done = engine.generate(tokens, GREEDY)
        passed += check(done.text)
        ttfts.append(done.ttft_ms)
    return passed / len(prompts), statistics.median(ttfts)


def scenario_checks(scenarios: list[dict]) -> list[tuple[str, list[str], Callable[[str], bool]]]:
    """(name, held-out prompts, check) of each scenario, each check built once for every
    stack it will score."""
    return [(s["name"], s["heldout"], checker(s)) for s in scenarios]


def heldout_shares(session: Session, stack, checks) -> dict[str, float]:
    """name -> `heldout_share` of each of `checks` (`scenario_checks`) under `stack`."""
    system = session.system_prompt
    return {name: heldout_share(session, stack, system, held, check)[0] for name, held, check in checks}


def seed_feedback(session: Session, scenario: dict, check, ratings_only: bool) -> None:
    """The simulated user: corrects each reply as the scenario says, or (`ratings_only`) asks,
    rates the reply +1 or -1 by the check, and regenerates it (sampled) up to
    RATINGS_PER_PROMPT - 1 times in the same conversation, rating each answer, as a user who
    never writes a correction does in the app."""
    for i, item in enumerate(scenario["train"]):
        session.new_conversation()
        reply = session.send(item["prompt"], params=GREEDY).wait()
        if not ratings_only:
            session.correct(reply.message_id, item["correction"])
            continue
        session.rate(reply.message_id, 1 if check(reply.text) else -1)
        for k in range(1, RATINGS_PER_PROMPT):
            params = dataclasses.replace(GREEDY, temperature=1.0, seed=1000 * i + k)
            reply = session.regenerate(reply.message_id, params=params).wait()
            session.rate(reply.message_id, 1 if check(reply.text) else -1)


def sft_baseline(model_path: Path, engine: Engine, episodes, steps: int, lr: float, rank: int) -> TorchBackend:
    """Plain supervised LoRA on the corrections: the usual approach, for comparison."""
    backend = TorchBackend(lr=lr)
    backend.load(model_path)
    backend.add_lora(rank=rank, alpha=2.0 * rank)
    pairs = [completion_tokens(engine, e.messages, e.chosen) for e in episodes if e.chosen]
    for step in range(steps):
        chunk = [pairs[(step * 4 + i) % len(pairs)] for i in range(4)]
        batch = make_batch([p for p, _ in chunk], [c for _, c in chunk])
        mask = backend.mask(batch)
        backend.step(-(backend.logprobs(batch) * mask).sum() / mask.sum())
    return backend


def trainer_vs_reference(backend: TorchBackend, engine: Engine, episodes, steps: int = 4) -> dict:
    """Our backend's step against a plain peft/transformers loop (model(labels=...).loss) on the
    same model and batch, alternating so machine noise hits both."""
    torch = backend.torch
    pairs = [completion_tokens(engine, e.messages, e.chosen) for e in episodes if e.chosen][:4]
    batch = make_batch([p for p, _ in pairs], [c for _, c in pairs])
    ids = torch.tensor(batch.input_ids)
    labels = torch.tensor(batch.targets)
    labels[torch.tensor(batch.mask) == 0] = -100
    full = torch.cat([ids[:, :1], labels.clamp(min=0)], dim=1)  # HF shifts labels itself
    hf_labels = torch.cat([torch.full_like(ids[:, :1], -100), labels], dim=1)
    optimizer = torch.optim.AdamW([p for p in backend.model.parameters() if p.requires_grad], lr=1e-5)
    ours, reference = [], []

    def sft(logp, reference, mask):
        return losses.sft_loss(logp, mask), {}

    for _ in range(steps):
        started = time.perf_counter()
        backend.train_step(batch, sft, with_reference=False)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        loss = backend.model(input_ids=full, labels=hf_labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.append(time.perf_counter() - started)
    tokens = batch.n_tokens
    return {
        "reference": "plain peft/transformers loop: model(input_ids, labels).loss.backward(); AdamW.step()",
        "ours_tokens_per_s": tokens / statistics.median(ours),
        "reference_tokens_per_s": tokens / statistics.median(reference),
        "ratio": statistics.median(reference) / statistics.median(ours),
    }


def learn_setting(item: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as TOML (72, 0.2, true, "text"): a [learn] setting as a user
    would write it, so `learn_config` types and checks it as it does for `macaron learn`."""
    key, _, value = item.partition("=")
    try:
        return key.strip(), tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        raise SystemExit(f"error: --learn {item!r} is not KEY=VALUE with a TOML value") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", type=Path, required=True)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, help="override the settings' [learn] steps")
    parser.add_argument("--lr", type=float, help="override the settings' [learn] lr")
    parser.add_argument("--rank", type=int, help="override the settings' [learn] rank (alpha = 2 * rank)")
    parser.add_argument("--backend", choices=("auto", "torch", "mlx"), help="the RL run's trainer")
    parser.add_argument("--ratings-only", action="store_true", help="the user rates replies, never corrects")
    parser.add_argument("--no-baselines", action="store_true", help="skip the SFT and trainer-speed baselines")
    parser.add_argument("--model", help="'tiny-qwen35moe' (built here) or a directory bench/tiny_tall.py built")
    parser.add_argument(
        "--learn",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one [learn] setting for this run (repeatable), as `macaron learn` would read it",
    )
    parser.add_argument("--threads", type=int, help="llama.cpp threads (the n_threads setting; default: its own)")
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario, corrections=not args.ratings_only)
    check = checker(scenario)
    started = time.perf_counter()

    home = Path(tempfile.mkdtemp(prefix="macaron-learn-bench-"))
    settings = Settings.load(home)
    settings.ensure_dirs()
    if args.model:  # Tall's architecture at toy size, registered as a local model of this home
        import tiny_tall

        built = Path(args.model) if Path(args.model).is_dir() else tiny_tall.build(home / "tiny-qwen35moe")
        tiny_tall.register(settings, built)
        settings = Settings.load(home)
    if args.threads:
        settings.save(n_threads=args.threads)
    if args.learn:
        settings.save(learn=dict(learn_setting(item) for item in args.learn))
    try:
        config = learn_config(settings)
    except MacaronError as exc:  # an unknown or mistyped --learn setting: one line, no traceback
        raise SystemExit(f"error: {exc}") from None  # what `macaron learn` and the daemon use
    overrides = {"steps": args.steps, "lr": args.lr, "backend": args.backend}
    if args.rank:
        overrides |= {"rank": args.rank, "alpha": 2.0 * args.rank}
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    config = dataclasses.replace(config, backend=choose_backend(config.backend))

    session = Session(settings, engine_config={"n_ctx": 2048})
    seed_feedback(session, scenario, check, args.ratings_only)
    episodes = episodes_from_store(session.store)
    routed = sorted({e.slot for e in episodes})
    engine, system = session.engine, session.system_prompt
    serve = serve_params(session.catalog)
    base = BaseModelInfo.from_gguf(session.model_path)

    before, _ = heldout_share(session, served_stack(session), system, scenario["heldout"], check)
    regression_before = regression_score(engine, served_stack(session), system, serve)

    # The real nightly run: plan, train, export, parity, gate, back off, register, deploy.
    learn_started = time.perf_counter()
    reports = learn_once(session.store, session.catalog, session.manifest, config)
    learn_wall = time.perf_counter() - learn_started
    session.close()
    session = Session(settings, engine_config={"n_ctx": 2048})  # serves what was deployed, as the app would
    engine = session.engine
    after, _ = heldout_share(session, served_stack(session), system, scenario["heldout"], check)
    regression_after = regression_score(engine, served_stack(session), system, serve)
    nll_delta = regression_after.passage_nll / regression_before.passage_nll - 1

    bare = bare_stack(session)  # prompt memory: the experts, no learned adapter

    if args.ratings_only:  # the same signal, pasted: the replies the user liked, then disliked
        ordered = sorted(episodes, key=lambda e: e.chosen is None)
        items = [
            "\n".join(
                [f"When asked: {e.messages[-1]['content']}"]
                + ([f"I liked: {e.chosen}"] if e.chosen else [])
                + [f"I disliked: {rejected}" for rejected in e.all_rejected]
            )
            for e in ordered
        ]
    else:
        items = [f"When asked: {t['prompt']}\nI wanted: {t['correction']}" for t in scenario["train"]]
    told = "rated" if args.ratings_only else "corrected"
    head = f"{system}\n\nThe user {told} earlier replies like this; answer in the same way.\n\n"
    # As much as fits the context next to a held-out prompt and its reply (36 rated replies do not).
    budget = session.engine.config.n_ctx - GREEDY.max_tokens - 256
    kept = 0
    while kept < len(items) and len(session.engine.tokenize(head + "\n\n".join(items[: kept + 1]))) <= budget:
        kept += 1
    memory_prompt = head + "\n\n".join(items[:kept])
    memory_after, memory_ttft = heldout_share(session, bare, memory_prompt, scenario["heldout"], check)
    _, plain_ttft = heldout_share(session, bare, system, scenario["heldout"][:3], check)

    report = {
        "scenario": scenario["name"],
        "home": str(home),
        "model": session.manifest.name,
        "feedback": "ratings" if args.ratings_only else "corrections",
        "prompt_memory_items": f"{kept} of {len(items)} (what fits the context)",
        "train_examples": len(scenario["train"]),
        "episodes": {  # what the learner was given: pairs, lone likes, lone dislikes
            "pairs": sum(1 for e in episodes if e.chosen and e.rejected),
            "liked": sum(1 for e in episodes if e.chosen and not e.rejected),
            "disliked": sum(1 for e in episodes if e.rejected and not e.chosen),
        },
        "heldout_prompts": len(scenario["heldout"]),
        "routed_to": routed,
        "before": before,
        "after": after,
        "regression_nll_before": round(regression_before.passage_nll, 4),
        "regression_nll_after": round(regression_after.passage_nll, 4),
        "regression_nll_delta": round(nll_delta, 4),
        "regression_qa_before": regression_before.qa_right,
        "regression_qa_after": regression_after.qa_right,
        "regression_qa_total": regression_before.qa_total,
        "deployed": any(r.decision == "deployed" for r in reports),
        "decision_reason": "; ".join(f"{r.slot}: {r.reason}" for r in reports) or "no feedback",
        "slots": [
            {
                "slot": r.slot,
                "decision": r.decision,
                "reason": r.reason,
                "version_id": r.version_id,
                "candidates": r.metrics.get("candidates", []),
                "metrics": {k: v for k, v in r.metrics.items() if k not in ("candidates", "losses")},
            }
            for r in reports
        ],
        "gate_metrics": reports[0].metrics if reports else {},
        "learn_wall_s": round(learn_wall, 1),
        "trainer_tokens_per_s": reports[0].metrics.get("trainer_tokens_per_s") if reports else None,
        "prompt_memory_after": memory_after,
        "prompt_memory_ttft_ms": round(memory_ttft, 1),
        "plain_ttft_ms": round(plain_ttft, 1),
    }
    if not args.no_baselines and not args.ratings_only:
        sft = sft_baseline(session.model_path, engine, episodes, steps=24, lr=1e-3, rank=config.rank)
        sft_adapter = engine.load_adapter(export_gguf(sft, base, home / "sft.gguf"))

        def with_sft(slot: str) -> list:
            return [*bare(slot), sft_adapter]

        sft_after, _ = heldout_share(session, with_sft, system, scenario["heldout"], check)
        sft_regression = regression_score(engine, with_sft, system, serve)
        speed = trainer_vs_reference(sft, engine, episodes)
        report |= {
            "sft_after": sft_after,
            "sft_regression_nll_delta": round(sft_regression.passage_nll / regression_before.passage_nll - 1, 4),
            "sft_regression_qa_after": sft_regression.qa_right,
            "trainer_vs_reference": round(speed["ratio"], 3),
            "trainer_vs_reference_detail": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in speed.items()},
        }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["config"] = dataclasses.asdict(config) | {"n_threads": int(settings.get("n_threads") or 0)}
    session.close()
    return emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
