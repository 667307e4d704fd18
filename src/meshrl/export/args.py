"""The options the exporters share, defined once: each ``meshrl export TARGET`` parser adds the ones it takes."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshrl.mesh.coach import TEMPLATES


def add_out(p: argparse.ArgumentParser, help: str = "output directory") -> None:
    """``--out DIR`` (required): where the export is written; :func:`meshrl.runs.check_out_dir` refuses a file."""
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help=help)


def add_task(p: argparse.ArgumentParser) -> None:
    """``--task SPEC`` (required): the task whose problems are exported."""
    p.add_argument("--task", required=True, help="task spec, as for `meshrl train` (e.g. rg:basic_arithmetic)")


def add_prefixes(p: argparse.ArgumentParser, *, required: bool, help: str = "prefix file from `meshrl coach`") -> None:
    """``--prefixes FILE``: a ``meshrl coach`` prefix file (``None`` when optional and not given)."""
    p.add_argument("--prefixes", type=Path, required=required, default=None, help=help)


def add_m(p: argparse.ArgumentParser) -> None:
    """``--m M``: coach prefixes per query."""
    p.add_argument("--m", type=int, default=4, help="coach prefixes per query (default 4, the paper's)")


def add_template(p: argparse.ArgumentParser) -> None:
    """``--template wrapped|plain``: the anti-hacking template around each prefix, or the prefix as is."""
    p.add_argument("--template", choices=TEMPLATES, default="wrapped",
                   help="wrap each prefix in the anti-hacking template (default) or use it as is")


def add_seed(p: argparse.ArgumentParser) -> None:
    """``--seed N``: the task's seed (generated problems, held-out split)."""
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")


def add_split(p: argparse.ArgumentParser) -> None:
    """``--split NAME``: the split whose problems are exported."""
    p.add_argument("--split", default="train", help="split to export (default train)")


def add_task_data(p: argparse.ArgumentParser, *, prefixes_required: bool,
                  prefixes_help: str = "prefix file from `meshrl coach`") -> None:
    """The options of a task-data export (``trl``, ``verl``): ``--task --prefixes --out --m --split --template
    --seed``."""
    add_task(p)
    add_prefixes(p, required=prefixes_required, help=prefixes_help)
    add_out(p)
    add_m(p)
    add_split(p)
    add_template(p)
    add_seed(p)
