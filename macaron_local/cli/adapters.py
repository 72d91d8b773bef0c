"""`macaron adapters validate|convert|list|show|diff|rollback`: check or produce GGUF LoRA adapters
for a base model, and inspect or move the registry's versions of the user's own adapters."""

from __future__ import annotations

import argparse
import sys

from macaron_local.adapters import STORAGE_TYPES, BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog
from macaron_local.cli.common import add_model_option, load_settings, print_json
from macaron_local.errors import InvalidInputError
from macaron_local.terminal import printable


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("adapters", help="validate or convert LoRA adapters")
    sub = parser.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)

    validate = sub.add_parser("validate", help="check that an adapter file is safe for the base model")
    validate.add_argument("file")
    validate.add_argument("--json", action="store_true")
    add_model_option(validate)
    validate.set_defaults(func=run_validate)

    listing = sub.add_parser("list", help="every adapter version in the registry, and which one is deployed")
    listing.add_argument("--slot", help="only this slot (personal, or an expert L0..L3)")
    listing.add_argument("--limit", type=int, default=50, help="the newest N versions (0: all); default 50")
    listing.add_argument("--json", action="store_true")
    add_model_option(listing)
    listing.set_defaults(func=run_list)

    show = sub.add_parser("show", help="one adapter version: lineage, what it learned from, evaluations")
    show.add_argument("version")
    show.set_defaults(func=run_show)

    diff = sub.add_parser("diff", help="what changed between two versions (default: a version and its parent)")
    diff.add_argument("version", help="the newer version")
    diff.add_argument("against", nargs="?", help="the older version (default: its parent; none: the bare expert)")
    diff.add_argument("--json", action="store_true")
    diff.set_defaults(func=run_diff)

    gc = sub.add_parser("gc", help="delete adapter files no version refers to")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    gc.set_defaults(func=run_gc)

    rollback = sub.add_parser("rollback", help="serve the previous version of an expert's personal adapter")
    rollback.add_argument("slot", help="personal (what learning deploys), or L0..L3 (chat, agent, coding, ui)")
    add_model_option(rollback)
    rollback.set_defaults(func=run_rollback)

    convert = sub.add_parser("convert", help="convert a PEFT LoRA directory to a GGUF adapter")
    convert.add_argument("peft_dir")
    convert.add_argument("output")
    convert.add_argument(
        "--type",
        "--dtype",
        dest="dtype",
        choices=list(STORAGE_TYPES),
        default="F16",
        help="GGUF storage type of the LoRA tensors (default F16; Q8_0 is the smallest measured to stay accurate)",
    )
    add_model_option(convert)
    convert.set_defaults(func=run_convert)


def _base(model: str | None) -> BaseModelInfo:
    catalog = Catalog(load_settings(readonly=True))
    manifest = catalog.get(model) if model else catalog.default()
    return BaseModelInfo.from_gguf(catalog.base_path(manifest))


def run_validate(args: argparse.Namespace) -> int:
    report = validate_adapter(args.file, _base(args.model))
    if args.json:
        print_json(
            {
                "ok": True,
                "path": str(report.path),
                "architecture": report.architecture,
                "alpha": report.alpha,
                "ranks": list(report.ranks),
                "pairs": report.n_pairs,
                "types": list(report.storage_types),
            }
        )
    else:
        print(printable(f"ok: {args.file}: {report.summary()}"))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from macaron_local.adapters.peft import convert_peft_dir
    from macaron_local.cli.progress import ProgressBar

    bar: ProgressBar | None = None

    def progress(done: int, total: int, tensor: str) -> None:
        nonlocal bar
        bar = bar or ProgressBar(total, label="converting")
        bar.update(done, printable(tensor))  # tensor names come from the file

    # A bar on a terminal only: piped, the output stays the one result line (or one error line).
    shown = progress if sys.stderr.isatty() else None
    try:
        out = convert_peft_dir(args.peft_dir, _base(args.model), args.output, dtype=args.dtype, progress=shown)
    finally:
        if bar is not None:
            bar.finish()
    print(f"wrote {out} ({args.dtype})")
    return 0


def _model_name(model: str | None) -> str:
    catalog = Catalog(load_settings(readonly=True))
    return (catalog.get(model) if model else catalog.default()).name


def run_list(args: argparse.Namespace) -> int:
    from macaron_local.store import open_default_store

    base_model = _model_name(args.model)
    slot = registry_slot(args.slot) if args.slot else None
    with open_default_store(load_settings(readonly=True), readonly=True) as store:
        if args.limit < 0:
            raise InvalidInputError("--limit must be 0 (all) or more")
        versions = store.adapter_versions(slot=slot, base_model=base_model, newest=args.limit or None)
    if args.json:
        print_json([vars(v) for v in versions])
        return 0
    if not versions:
        print(f"no adapter versions for {base_model} yet: learning has not produced any")
        return 0
    if args.limit and len(versions) == args.limit:
        print(f"(the newest {args.limit}; --limit 0 lists all)")
    for version in versions:
        mark = "*" if version.status == "deployed" else " "
        print(
            f"{mark} {version.id}  {version.slot}  {version.status:<9} rank {version.rank}  {version.created_at[:16]}"
        )
    return 0


def run_show(args: argparse.Namespace) -> int:
    from macaron_local.store import open_default_store

    with open_default_store(load_settings(readonly=True), readonly=True) as store:
        print_json(vars(store.adapter_version(args.version)))
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    from macaron_local.store import open_default_store

    slot, base_model = registry_slot(args.slot), _model_name(args.model)
    with open_default_store(load_settings()) as store:
        restored = store.rollback_adapter(slot, base_model)
    if restored is None:
        print(f"{slot} on {base_model} is back to the bare expert (no personal adapter)")
    else:
        print(f"{slot} on {base_model} now serves {restored.id}")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from macaron_local.adapters.diff import diff_adapters
    from macaron_local.store import open_default_store

    settings = load_settings(readonly=True)
    with open_default_store(settings, readonly=True) as store:
        new = store.adapter_version(args.version)
        against = args.against or new.parent_id
        old = store.adapter_version(against) if against else None
    catalog = Catalog(settings)
    base = BaseModelInfo.from_gguf(catalog.base_path(catalog.get(new.base_model)))
    for version in (v for v in (old, new) if v is not None):
        validate_adapter(version.path, base)  # a damaged file gets one line, never a crash
    weights = diff_adapters(old.path if old else None, new.path)
    old_feedback = set(old.feedback_ids) if old else set()
    keys = sorted(set(new.evaluations) | set(old.evaluations if old else {}))
    evaluations = {
        k: [old.evaluations.get(k) if old else None, new.evaluations.get(k)]
        for k in keys
        if not isinstance(new.evaluations.get(k), list)
    }
    report = {
        "version": new.id,
        "against": old.id if old else None,
        "slot": new.slot,
        "feedback_added": sorted(set(new.feedback_ids) - old_feedback),
        "feedback_removed": sorted(old_feedback - set(new.feedback_ids)),
        "evaluations": evaluations,
        "norm_old": weights.norm_old,
        "norm_new": weights.norm_new,
        "distance": weights.distance,
        "tensors": [vars(c) for c in weights.changes],
    }
    if args.json:
        print_json(report)
        return 0
    print(f"{new.id} ({new.slot}, {new.status}) against " + (f"{old.id} ({old.status})" if old else "the bare expert"))
    print(
        f"learned from {len(new.feedback_ids)} feedback row(s): "
        f"{len(report['feedback_added'])} new, {len(report['feedback_removed'])} dropped"
    )
    changed = {k: v for k, v in evaluations.items() if v[0] != v[1]}
    if changed:
        print("evaluations:")
        for key, (before, after) in changed.items():
            print(f"  {key:<24} {before!s:>10} -> {after!s}")
    share = f" ({weights.distance / weights.norm_old:.0%} of the old update)" if weights.norm_old else ""
    norms = f"{weights.norm_old:.4g} -> {weights.norm_new:.4g}"
    print(f"weights: update norm {norms}, changed by {weights.distance:.4g}{share}")
    print("largest changes:")
    for change in weights.largest(5):
        print(f"  {change.tensor:<28} {change.norm_old:.4g} -> {change.norm_new:.4g}  (by {change.distance:.4g})")
    return 0


def run_gc(args: argparse.Namespace) -> int:
    from macaron_local.store import open_default_store

    with open_default_store(load_settings()) as store:
        print(store.collect_garbage(dry_run=args.dry_run).summary())
    return 0


def registry_slot(value: str) -> str:
    """`personal` (the adapter learning deploys for every expert), or an expert slot."""
    from macaron_local.learn.personal import PERSONAL_SLOT
    from macaron_local.router import normalize_slot

    return PERSONAL_SLOT if value.strip().lower() == PERSONAL_SLOT else normalize_slot(value)
