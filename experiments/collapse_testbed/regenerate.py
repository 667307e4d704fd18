"""Regenerate every committed table from the committed data and compare it byte for byte.

``python -m experiments.collapse_testbed.regenerate [--only NAME ...] [--keep DIR]``: for each entry of
``COMMITTED`` (README.md, "Results and the command behind each"), run the command that made the table into a
temporary directory and compare its ``results.md`` with the committed file. Exit status 1 and a unified diff
when one differs. No training: seconds per table.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"

#: table name -> (committed table, arguments of ``python -m experiments.collapse_testbed`` with OUT for --out)
COMMITTED: dict[str, tuple[str, list[str]]] = {
    # the first experiment (preset round1): its results.json, kept in its data file
    "first": ("testbed_experiment_results.md", ["--tables-from", "data/testbed_experiment.json.gz"]),
    # the entropy-collapse plug-ins (preset plugins): the results.json itself
    "plugins": ("testbed_plugins_results.md", ["--tables-from", "data/testbed_plugins.json.gz"]),
    # the second experiment (preset round2) and the audit family: packs, summarized again from the runs
    "second": ("testbed_round2_results.md", ["--unpack", "data/testbed_round2.json.gz", "--summarize-only"]),
    "audit": ("testbed_audit_results.md", ["--unpack", "data/testbed_audit.json.gz", "--summarize-only"]),
    "readinglist": ("testbed_readinglist_results.md",
                    ["--unpack", "data/testbed_readinglist.json.gz", "--summarize-only", "--preset", "readinglist"]),
    # GRPO, forking tokens and the coach-guided arms for 120 steps (preset long)
    "long": ("testbed_long_results.md",
             ["--unpack", "data/testbed_long.json.gz", "--summarize-only", "--preset", "long"]),
}


PERSISTENCE_PACKS = {"W1": "data/testbed_persistence_W1.json.gz", "W2": "data/testbed_persistence_W2.json.gz",
                     "W3": "data/testbed_persistence_W3.json.gz"}
#: persistence-experiment tables (preregistration.md) -> (committed table, warm start -> its pack, the analysis:
#: persistence.py's endpoints and tests, or mei_harm.py's MEI-against-harm)
PERSISTENCE: dict[str, tuple[str, dict[str, str], str]] = {
    "persistence": ("testbed_persistence_results.md", PERSISTENCE_PACKS, "persistence"),
    "mei_harm": ("testbed_mei_harm_results.md", PERSISTENCE_PACKS, "mei_harm"),
}


#: the staleness experiment's table (preregistration_staleness.md) -> (committed table, its pack, the pack of the k = 0
#: runs remade on the CPU of a seed's k = 1, 2, 4 arms, the pack of k = 0 runs made again on one more CPU for the CPU
#: check); the k = 0 check reads the persistence experiment's W2 pack
STALENESS: dict[str, tuple[str, str, str, str]] = {
    "staleness": ("testbed_staleness_results.md", "data/testbed_staleness.json.gz",
                  "data/testbed_staleness_k0_remade.json.gz", "data/testbed_staleness_k0_cpu_check.json.gz")}


def regenerate_staleness(name: str, work: Path) -> tuple[str, str]:
    """(regenerated, committed) text of the staleness table: its pack and W2's unpacked under ``work``."""
    from experiments.collapse_testbed import staleness
    from experiments.collapse_testbed.pack import unpack_experiment

    table, pack, remade, cpu_check = STALENESS[name]
    unpack_experiment(HERE / pack, work / name / "runs")
    unpack_experiment(HERE / PERSISTENCE_PACKS["W2"], work / name / "W2")
    unpack_experiment(HERE / remade, work / name / "k0_remade")
    unpack_experiment(HERE / cpu_check, work / name / "k0_cpu_check")
    with contextlib.redirect_stdout(io.StringIO()):
        rc = staleness.main([str(work / name / "runs"), "--reference", str(work / name / "W2"),
                             "--remade", str(work / name / "k0_remade"),
                             "--cpu-check", str(work / name / "k0_cpu_check"),
                             "--out", str(work / name / "staleness.md")])
    if rc != 0:
        raise RuntimeError(f"regenerating {name} failed (exit status {rc})")
    return (work / name / "staleness.md").read_text(), (DATA / table).read_text()


def regenerate_persistence(name: str, work: Path) -> tuple[str, str]:
    """(regenerated, committed) text of persistence table ``name``: each warm start's pack unpacked under ``work``,
    then its analysis over all of them."""
    import importlib

    from experiments.collapse_testbed.pack import unpack_experiment

    table, packs, tool = PERSISTENCE[name]
    analysis = importlib.import_module(f"experiments.collapse_testbed.{tool}")
    dirs = []
    for warm, pack in packs.items():
        unpack_experiment(HERE / pack, work / name / warm)
        dirs.append(f"{warm}={work / name / warm}")
    with contextlib.redirect_stdout(io.StringIO()):
        rc = analysis.main([*dirs, "--out", str(work / name / "persistence.md")])
    if rc != 0:
        raise RuntimeError(f"regenerating {name} failed (exit status {rc})")
    return (work / name / "persistence.md").read_text(), (DATA / table).read_text()


def regenerate(name: str, work: Path) -> tuple[str, str]:
    """(regenerated, committed) text of table ``name``, made under ``work``."""
    from experiments.collapse_testbed.cli import main

    if name in PERSISTENCE:
        return regenerate_persistence(name, work)
    if name in STALENESS:
        return regenerate_staleness(name, work)
    table, args = COMMITTED[name]
    out = work / name
    argv = [str(HERE / a) if a.startswith("data/") else a for a in args]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main([*argv, "--out", str(out), "--no-figures", "--no-progress"])
    if rc != 0:
        raise RuntimeError(f"regenerating {name} failed (exit status {rc})")
    return (out / "results.md").read_text(), (DATA / table).read_text()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.collapse_testbed.regenerate", description=__doc__)
    names = [*COMMITTED, *PERSISTENCE, *STALENESS]
    p.add_argument("--only", nargs="+", choices=names, default=names)
    p.add_argument("--keep", type=Path, default=None, help="work here (kept) instead of a temporary directory")
    args = p.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        for name in args.only:
            new, old = regenerate(name, work)
            same = new == old
            table = {**COMMITTED, **PERSISTENCE, **STALENESS}[name][0]
            print(f"{name}: {'identical' if same else 'DIFFERS'} ({table})")
            if not same:
                failed += 1
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                           "committed", "regenerated"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
