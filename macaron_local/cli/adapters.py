"""`macaron adapters validate|convert`: check or produce GGUF LoRA adapters for a base model."""

from __future__ import annotations

import argparse

from macaron_local.adapters import STORAGE_TYPES, BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog
from macaron_local.cli.common import add_model_option, load_settings, print_json


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("adapters", help="validate or convert LoRA adapters")
    sub = parser.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)

    validate = sub.add_parser("validate", help="check that an adapter file is safe for the base model")
    validate.add_argument("file")
    validate.add_argument("--json", action="store_true")
    add_model_option(validate)
    validate.set_defaults(func=run_validate)

    convert = sub.add_parser("convert", help="convert a PEFT LoRA directory to a GGUF adapter")
    convert.add_argument("peft_dir")
    convert.add_argument("output")
    convert.add_argument("--dtype", choices=sorted(STORAGE_TYPES), default="F16")
    add_model_option(convert)
    convert.set_defaults(func=run_convert)


def _base(model: str | None) -> BaseModelInfo:
    catalog = Catalog(load_settings())
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
        print(f"ok: {args.file}: {report.summary()}")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from macaron_local.adapters.peft import convert_peft_dir

    out = convert_peft_dir(args.peft_dir, _base(args.model), args.output, dtype=args.dtype)
    print(f"wrote {out}")
    return 0
