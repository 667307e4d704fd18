"""``python -m experiments.real_model run|pack|table``: the runs (resumable), their pack, the table (README.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments._args import check_seeds

HERE = Path(__file__).resolve().parent
PACK = HERE / "data" / "real_model.json.gz"
TABLE = HERE / "data" / "real_model_results.md"


def main(argv: list[str] | None = None) -> int:
    from experiments.real_model import analysis, experiment

    ap = argparse.ArgumentParser(prog="python -m experiments.real_model", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run", "pack", "table"))
    ap.add_argument("--out", type=Path, default=Path("runs/real_model"), help="the runs' directory")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the pre-registered 0 1 2")
    ap.add_argument("--arms", nargs="+", choices=list(experiment.ARMS), default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--pack-file", type=Path, default=PACK)
    ap.add_argument("--table-file", type=Path, default=TABLE)
    args = ap.parse_args(argv)
    try:
        check_seeds(args.seeds)
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from meshrl.kernel_caches import bound_kernel_caches

    bound_kernel_caches()
    if args.command == "run":
        changes = {"threads": args.threads, **({"seeds": tuple(args.seeds)} if args.seeds else {}),
                   **({"arms": tuple(args.arms)} if args.arms else {})}
        try:
            experiment.run_all(experiment.Settings(**changes), args.out)
        except KeyboardInterrupt as err:  # SIGTERM (the trainer's RunInterrupted) or Ctrl-C: no traceback
            from experiments._runs import stopped

            return stopped(err)
    elif args.command == "pack":
        print(experiment.pack(args.out, args.pack_file))
    else:
        text = analysis.table(analysis.analyse(experiment.read_pack(args.pack_file)))
        args.table_file.write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
