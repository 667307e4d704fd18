"""``python -m experiments.health_corpus``: gather a labelled corpus, pack it, score the doctor on it.

    python -m experiments.health_corpus --corpus DIR [--testbed-pack P ...] [--testbed-dir D ...] --out OUT
    python -m experiments.health_corpus --from-pack OUT/corpus.json.gz --out OUT2     # rescore a pack

writes ``OUT/corpus.json.gz`` (``pack.py``) and ``OUT/results.md`` (``tables.py``). The tables are always made
from the pack (so a committed pack regenerates its committed tables byte for byte).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from experiments.health_corpus.corpus import (
    CorpusRun,
    experiment_name,
    load_corpus,
    recovered_as_ambiguous,
    testbed_pack_runs,
    testbed_runs,
)
from experiments.health_corpus.pack import pack_corpus, unpack_corpus, verify_trimmed
from experiments.health_corpus.score import score_run, signal_grids, summarize
from experiments.health_corpus.tables import render
from meshrl.kernel_caches import bound_kernel_caches

log = logging.getLogger("meshrl")


def gather(corpus: list[Path], packs: list[Path], dirs: list[Path], *, attach_evals: bool = True) -> list[CorpusRun]:
    """Every run of the given corpus directories, testbed packs and testbed experiment directories."""
    runs: list[CorpusRun] = []
    for path in [*corpus, *packs, *dirs]:
        if not path.exists():
            raise ValueError(f"{path}: no such file or directory")
    for root in corpus:
        runs += load_corpus(root)
    for pack in packs:
        runs += testbed_pack_runs(pack, experiment_name(pack), attach_evals=attach_evals)
    for d in dirs:
        runs += testbed_runs(d, experiment_name(d), attach_evals=attach_evals)
    return runs


def tables_from_pack(pack: Path) -> str:
    """``results.md`` of a corpus pack, scored with the settings stored in it."""
    runs, settings = unpack_corpus(pack)
    every = int(settings.get("every", 1))
    grids = signal_grids(runs)
    start = time.perf_counter()
    scores = [score_run(r, grids, every=every) for r in runs]
    log.info("scored %d runs in %.1f s", len(runs), time.perf_counter() - start)
    return render(summarize(scores), {"every": every})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.health_corpus", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, action="append", default=[], help="a directory of labelled runs")
    p.add_argument("--testbed-pack", type=Path, action="append", default=[], help="a collapse-testbed pack")
    p.add_argument("--testbed-dir", type=Path, action="append", default=[], help="a collapse-testbed experiment")
    p.add_argument("--from-pack", type=Path, help="rescore a corpus pack instead of gathering runs")
    p.add_argument("--every", type=int, default=1, help="evaluate the live doctor every K-th step (default 1)")
    p.add_argument("--hide-ckpt-evals", action="store_true",
                   help="do not show the testbed's checkpoint evaluations to the doctor as held-out records")
    p.add_argument("--recovered-ambiguous", action="store_true",
                   help="label a testbed run whose niche fell but was kept at the end ambiguous, not harmful")
    p.add_argument("--out", type=Path, required=True)
    return p


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option for a value that cannot work, before anything is read or written."""
    if args.every < 1:
        raise ValueError(f"--every must be >= 1, got {args.every}")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a directory")
    if args.from_pack is not None and not args.from_pack.is_file():
        raise ValueError(f"--from-pack {args.from_pack}: no such file")
    for flag, paths in (("--corpus", args.corpus), ("--testbed-pack", args.testbed_pack),
                        ("--testbed-dir", args.testbed_dir)):
        for path in paths:
            if not path.exists():
                raise ValueError(f"{flag} {path}: no such file or directory")


def main(argv: list[str] | None = None) -> int:
    bound_kernel_caches()  # first: oneDNN reads its cache sizes once (meshrl.kernel_caches)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:  # bad input: one line and exit status 2, as in ``meshrl``
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.from_pack:
            pack = args.from_pack
        else:
            runs = gather(args.corpus, args.testbed_pack, args.testbed_dir, attach_evals=not args.hide_ckpt_evals)
            if args.recovered_ambiguous:
                runs = recovered_as_ambiguous(runs)
            if not runs:
                print("no runs found: give --corpus, --testbed-pack or --testbed-dir", file=sys.stderr)
                return 2
            pack = args.out / "corpus.json.gz"
            info = pack_corpus(runs, pack, {"every": args.every})
            bad = verify_trimmed(runs, unpack_corpus(pack)[0])
            if bad:
                print(f"the pack's trimmed records change the doctor's verdict on: {', '.join(bad)}", file=sys.stderr)
                return 1
            log.info("packed %d runs into %s (%d bytes)", info["runs"], pack, info["bytes"])
        text = tables_from_pack(pack)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    log.info("wrote %s", args.out / "results.md")
    return 0
