"""`macaron models list|pull|verify|add`: the models this machine knows and has."""

from __future__ import annotations

import argparse

from macaron_local.catalog import Catalog
from macaron_local.cli.common import load_settings, print_json
from macaron_local.terminal import printable


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("models", help="list, download, verify or add models")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    listing = sub.add_parser("list", help="list known models and whether they are here")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=run_list)

    pull = sub.add_parser("pull", help="download a model and its expert adapters")
    pull.add_argument("name")
    pull.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    pull.add_argument("--dry-run", action="store_true", help="list the files it would fetch (sizes from the hub)")
    pull.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    pull.set_defaults(func=run_pull)

    verify = sub.add_parser("verify", help="check a model's files (sha256 where known) and adapters")
    verify.add_argument("name", nargs="?")
    verify.set_defaults(func=run_verify)

    add = sub.add_parser("add", help="register a local GGUF file as a model")
    add.add_argument("name")
    add.add_argument("path")
    add.set_defaults(func=run_add)


def run_list(args: argparse.Namespace) -> int:
    settings = load_settings(readonly=True)
    catalog = Catalog(settings)
    default = settings.get("model")
    rows = []
    for manifest in catalog.manifests():
        path = catalog.base_path(manifest)
        experts = {slot: catalog.expert_path(manifest, slot) for slot in manifest.experts}
        rows.append(
            {
                "name": manifest.name,
                "default": manifest.name == default,
                "description": manifest.description,
                "architecture": manifest.architecture,
                "source": manifest.base.kind,
                "present": path.is_file(),
                "path": str(path),
                "experts": {slot: (str(p) if p else None) for slot, p in experts.items()},
            }
        )
    if args.json:
        print_json(rows)
        return 0
    for row in rows:
        mark = "*" if row["default"] else " "
        state = "here" if row["present"] else "not downloaded"
        adapters = sum(1 for p in row["experts"].values() if p)
        print(printable(f"{mark} {row['name']:<12} {state:<15} {adapters}/4 expert adapters  {row['description']}"))
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from macaron_local.download import pull

    catalog = Catalog(load_settings())
    if args.dry_run:
        return _dry_run(catalog, args)
    result = pull(catalog, catalog.get(args.name), progress=not args.quiet)
    for name in result.skipped:
        print(f"already here: {name}")
    for path in [*result.files, *result.profiles]:
        print(f"ready: {path}")
    return 0


def _dry_run(catalog: Catalog, args: argparse.Namespace) -> int:
    """Print the plan; exit 1 (after printing it) when the hub says a listed file is not there."""
    from macaron_local.errors import DownloadError
    from macaron_local.pull_plan import plan_pull

    plan = plan_pull(catalog, catalog.get(args.name))
    if args.json:
        print_json(plan.to_json())
    else:
        for f in plan.files:
            size = "size unknown" if f.size is None else f"{f.size:,} bytes"
            state = "here" if f.present else "to fetch"
            print(f"{state:<8} {f.role:<7} {f.repo} {f.path} ({size})")
        for c in plan.convert:
            print(f"convert  {c['slot']}: {c['from']} -> {c['out']} as {c['type']}")
        total = plan.total_bytes
        known = f"{total:,} bytes" if total is not None else f"at most {plan.bound_bytes:,} bytes (sizes unknown)"
        print(f"download: {known}; disk needed: at most {plan.disk_bytes:,} bytes")
        if plan.hub.get("error"):
            print(f"hub: {plan.hub['error']}")
    missing = plan.missing_on_hub
    if missing:
        names = ", ".join(f"{f.repo} {f.path}" for f in missing[:3])
        raise DownloadError(f"not on the hub: {names}{' ...' if len(missing) > 3 else ''}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from macaron_local.doctor import verify_model

    catalog = Catalog(load_settings(readonly=True))
    manifest = catalog.get(args.name) if args.name else catalog.default()
    checks = verify_model(catalog, manifest, check_hash=True)
    for check in checks:
        print(printable(f"{'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}"))
    return 0 if all(c.ok for c in checks) else 1


def run_add(args: argparse.Namespace) -> int:
    manifest = Catalog(load_settings()).add_local(args.name, args.path)
    print(f"added {manifest.name}: {manifest.description} ({manifest.architecture})")
    return 0
