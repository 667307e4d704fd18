"""``meshrl export TARGET``: a run's policy in a format another tool loads.

Each exporter in :data:`EXPORTERS` adds one ``TARGET`` subcommand through
``add_export_parser(export_subparsers)`` and sets its ``func``; ``model`` writes a Hugging Face model directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Protocol

from meshrl.integrations.trl import export as trl_export
from meshrl.integrations.verl import export as verl_export

MODEL_HELP = """Write checkpoint STEP of RUN_DIR as a Hugging Face directory that AutoModelForCausalLM and
AutoTokenizer load offline: model.safetensors, config.json, generation_config.json (the run's sampling
settings), the tokenizer with its chat template, and meshrl.json (run, step, recipe, held-out figures).
LoRA runs are merged unless --adapter. The export is loaded back and checked against the checkpoint before
it is moved into place."""


class Exporter(Protocol):
    """What :data:`EXPORTERS` holds (a module or an object): adds its subcommand and sets ``func``."""

    def add_export_parser(self, export_subparsers: argparse._SubParsersAction) -> None: ...


class ModelExporter:
    """``meshrl export model``: :func:`meshrl.models.export.export_model`."""

    @staticmethod
    def add_export_parser(export_subparsers: argparse._SubParsersAction) -> None:
        _add_model_parser(export_subparsers)


def _add_model_parser(export_sub: argparse._SubParsersAction) -> None:
    p = export_sub.add_parser("model", help="a run checkpoint as a Hugging Face model directory",
                              description=MODEL_HELP)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a meshrl training run directory")
    p.add_argument("--step", default="final", metavar="N|best|final",
                   help="checkpoint: a step number, best (summary.json's checkpoint rule) or final "
                        "(the last checkpoint; default)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="new directory to write (must not exist)")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write the peft adapter directory instead of merged weights")
    p.set_defaults(func=_run_model)


def _run_model(args: argparse.Namespace) -> int:
    from meshrl.models.export import export_model

    info = export_model(args.run_dir, args.out, which=args.step, adapter=args.adapter)
    print(json.dumps({"out": str(args.out), "step": info["step"], "selected_by": info["selected_by"],
                      "format": info["format"]}, indent=1))
    return 0


# One entry per `meshrl export TARGET`.
EXPORTERS: list[Exporter] = [ModelExporter(), trl_export, verl_export]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run's policy (a Hugging Face model directory, ...)",
                       description="Export a trained policy in a format other tools load.")
    export_sub = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    for exporter in EXPORTERS:
        exporter.add_export_parser(export_sub)
