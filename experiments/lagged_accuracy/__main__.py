"""``python -m experiments.lagged_accuracy run|pack|table``: the runs (resumable), their pack, the table (README.md).

``table`` reads the run directory when ``--out`` is given, else the pack (``--pack-file``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from experiments._args import check_at_least

HERE = Path(__file__).resolve().parent
OUT = Path("runs/lagged_accuracy")
PACK = HERE / "data" / "lagged_accuracy.json.gz"
TABLE = HERE / "data" / "lagged_accuracy_results.md"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.lagged_accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run", "pack", "table"))
    ap.add_argument("--out", type=Path, default=None, help=f"the runs' directory (default {OUT})")
    ap.add_argument("--workers", type=int, default=2, help="runs at a time, one torch thread each")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default: the pre-registered 100)")
    ap.add_argument("--pack-file", type=Path, default=PACK)
    ap.add_argument("--table-file", type=Path, default=TABLE)
    return ap


def command(args: argparse.Namespace) -> None:
    from experiments.lagged_accuracy import analysis, experiment

    if args.command == "run":
        s = experiment.Settings()
        experiment.run_all(s if args.steps is None else replace(s, steps=args.steps), args.out or OUT, args.workers)
    elif args.command == "pack":
        print(experiment.pack(args.out or OUT, args.pack_file))
    else:
        text = analysis.table(analysis.analyse(analysis.load(args.out or args.pack_file)))
        args.table_file.parent.mkdir(parents=True, exist_ok=True)
        args.table_file.write_text(text)
        print(text)


def main(argv: list[str] | None = None) -> int:
    from meshrl.kernel_caches import bound_kernel_caches

    bound_kernel_caches()  # first: oneDNN reads its cache sizes once (meshrl.kernel_caches)
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_at_least([("--workers", args.workers, 1), ("--steps", args.steps, 1)])
        if args.out is not None and args.command == "table" and not args.out.is_dir():
            raise ValueError(f"--out {args.out}: no such directory")
        command(args)
    except ValueError as err:  # bad input: one clear line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # SIGTERM (the trainer's RunInterrupted) or Ctrl-C: no traceback
        from experiments._runs import stopped

        return stopped(err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
