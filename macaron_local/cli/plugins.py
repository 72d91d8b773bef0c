"""`macaron plugins import|list|remove`: LoRA modules made elsewhere, kept in the adapter registry."""

from __future__ import annotations

import argparse
from pathlib import Path

from macaron_local.cli.common import load_settings, print_json
from macaron_local.store.registry import Plugin
from macaron_local.terminal import printable


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("plugins", help="import, list or remove plugin LoRA modules")
    sub = parser.add_subparsers(dest="plugins_command", metavar="ACTION", required=True)

    importing = sub.add_parser("import", help="check a GGUF LoRA or PEFT directory and add it to the registry")
    importing.add_argument("path", help="a GGUF adapter file, or a directory (PEFT, or one .gguf) with plugin.toml")
    importing.add_argument("--name", help="plugin name (default: the manifest's, else the file name)")
    importing.add_argument("--slot", help="expert slot (L0..L3, chat/agent/coding/ui) or the name of a new expert")
    importing.add_argument("--base-model", help="the model it was trained for (default: the configured model)")
    importing.add_argument("--manifest", help="a plugin manifest (TOML, or JSON) other than the directory's own")
    importing.add_argument("--json", action="store_true")
    importing.set_defaults(func=run_import)

    listing = sub.add_parser("list", help="imported plugins")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=run_list)

    remove = sub.add_parser("remove", help="forget a plugin and delete its file (unless another version uses it)")
    remove.add_argument("name")
    remove.set_defaults(func=run_remove)


def as_json(plugin: Plugin) -> dict:
    return vars(plugin)


def _target(plugin: Plugin) -> str:
    return f"new expert {plugin.slot!r}" if plugin.new_expert else plugin.slot


def run_import(args: argparse.Namespace) -> int:
    from macaron_local.catalog import Catalog
    from macaron_local.plugins import import_plugin
    from macaron_local.store import open_default_store

    settings = load_settings()
    with open_default_store(settings) as store:
        imported = import_plugin(
            store,
            Catalog(settings),
            Path(args.path),
            name=args.name,
            slot=args.slot,
            base_model=args.base_model,
            manifest=Path(args.manifest) if args.manifest else None,
        )
    plugin = imported.plugin
    if args.json:
        print_json(as_json(plugin))
        return 0
    checked = (
        f"checked against {plugin.base_model}"
        if plugin.validated
        else f"structure checked; {plugin.base_model} is not on this machine, so the fit is checked when it loads"
    )
    print(
        printable(
            f"imported plugin {plugin.name} for {_target(plugin)} on {plugin.base_model} as version {plugin.version_id}"
        )
    )
    print(printable(f"  {imported.report.summary()}; {checked}"))
    return 0


def run_list(args: argparse.Namespace) -> int:
    from macaron_local.store import open_default_store

    with open_default_store(load_settings(readonly=True), readonly=True) as store:
        plugins = store.plugins()
    if args.json:
        print_json([as_json(p) for p in plugins])
        return 0
    if not plugins:
        print("no plugins imported: `macaron plugins import PATH` adds one")
        return 0
    for p in plugins:
        checked = "checked" if p.validated else "unchecked"
        print(
            printable(
                f"{p.name:<24} {_target(p):<20} {p.base_model:<12} {p.format:<4} rank {p.rank:<3} {checked}  "
                f"{p.version_id}"
            )
        )
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from macaron_local.plugins import remove_plugin
    from macaron_local.store import open_default_store

    with open_default_store(load_settings()) as store:
        plugin, collected = remove_plugin(store, args.name)
    freed = (
        f"deleted its file ({collected.freed_bytes / 1e6:.2f} MB)"
        if collected.removed
        else "its file stays: another version uses it"
    )
    print(f"removed plugin {plugin.name} (version {plugin.version_id}); {freed}")
    return 0
