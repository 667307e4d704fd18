"""``meshrl export TARGET``: the command, one subcommand per exporter in :data:`EXPORTERS`.

Each exporter adds its ``TARGET`` subcommand through ``add_export_parser(export_subparsers)`` and sets its ``func``;
the options they share are defined once, in :mod:`meshrl.export.args`.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from meshrl.export import model, trl, verl


class Exporter(Protocol):
    """What :data:`EXPORTERS` holds (a module or an object): adds its subcommand and sets ``func``."""

    def add_export_parser(self, export_subparsers: argparse._SubParsersAction) -> None: ...


# One entry per `meshrl export TARGET`.
EXPORTERS: list[Exporter] = [model, trl, verl]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run's policy (a Hugging Face model directory, ...)",
                       description="Export a trained policy in a format other tools load.")
    export_sub = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    for exporter in EXPORTERS:
        exporter.add_export_parser(export_sub)
