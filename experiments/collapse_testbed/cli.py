"""``python -m experiments.collapse_testbed``: run a testbed experiment (all arms x seeds), then its tables.

Run from the repository root (README.md). Bad input is one line on stderr and exit status 2, as in ``meshrl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from experiments._args import check_at_least, check_seeds
from meshrl.kernel_caches import bound_kernel_caches


def build_parser() -> argparse.ArgumentParser:
    from experiments.collapse_testbed.experiment import ARMS, DEFAULT_PRESET, PRESETS
    from experiments.collapse_testbed.shipped import WARM_STARTS

    p = argparse.ArgumentParser(
        prog="python -m experiments.collapse_testbed",
        description="Runs the arms of a preset (presets.yaml) on a collapse testbed from one warm start: round1 "
        "(the first experiment: GRPO, DAPO, GRPO+KL, GRPO+JS, CP-only, Mesh at several mu, support balancing, "
        "15 arms x 3 seeds), round2 (the second, the default: the headline arms x 5 seeds, per-prefix budget arms "
        "against GRPO with the same rollouts per query, the applicable coach, the coach-following reward and a "
        "half-budget prefix-free group) or plugins (GRPO with each entropy-collapse plug-in); evaluates pass@k "
        "by problem type, every checkpoint (final vs best) and the niche kept/lost per seed with Fisher's exact "
        "test; probes checkpoints for the warning-signal tables; writes results.json, results.md and figures. "
        "Resumable: finished runs, evaluations and probes are reused.")
    p.add_argument("--out", type=Path, default=Path("runs/testbed_experiment"))
    p.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET)
    p.add_argument("--task", choices=["testbed:add", "testbed:audit"], default=None,
                   help="task family (default testbed:add; testbed:audit is the second family)")
    p.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), metavar="ARM",
                   help="default: the preset's arms (arms.yaml lists them all)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the preset's seeds")
    p.add_argument("--probe-arms", nargs="*", default=None, choices=list(ARMS), metavar="ARM",
                   help="arms whose checkpoints are probed for the warning signals (default: the preset's)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--ckpt-eval-every", type=int, default=None,
                   help="evaluate a checkpoint every N steps in every arm (0 = final only)")
    p.add_argument("--workers", type=int, default=None, help="runs in parallel (one thread each)")
    p.add_argument("--warm", choices=list(WARM_STARTS), default=None,
                   help="start every arm from this shipped warm start (warm_starts/, SHA-256 checked; its settings "
                   "replace the preset's warm_* settings); default: build or reuse one from the preset's settings")
    p.add_argument("--build-warm-starts", nargs="*", default=None, choices=list(WARM_STARTS), metavar="NAME",
                   help="no runs: build the named shipped warm starts (default: all) that warm_starts/MANIFEST.json "
                   "lacks, one thread each, and record their SHA-256; with --force rebuild them")
    p.add_argument("--force", action="store_true", help="with --build-warm-starts: rebuild existing ones")
    p.add_argument("--summarize-only", action="store_true", help="only rebuild the tables and figures")
    p.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib needed)")
    p.add_argument("--pack", type=Path, default=None, metavar="FILE.json.gz",
                   help="after the tables, write the compact per-run data (no weights, no training rollouts)")
    p.add_argument("--pack-finished", type=Path, default=None, metavar="FILE.json.gz",
                   help="only write the pack of --out's finished runs (done.json), no tables; safe while the "
                        "experiment runs (a partial pack, committed as it grows)")
    p.add_argument("--unpack", type=Path, default=None, metavar="FILE.json.gz",
                   help="first write a pack's files into --out (then use --summarize-only to rebuild the tables)")
    p.add_argument("--tables-from", type=Path, default=None, metavar="RESULTS.json[.gz]",
                   help="no runs: the tables (and figures) of a finished experiment's results.json, or of a pack "
                   "that holds one, into --out")
    p.add_argument("--no-progress", action="store_true")
    return p


def settings_from_args(args: argparse.Namespace):
    """``ExperimentSettings`` of ``--preset`` with the options given on the command line on top."""
    from experiments.collapse_testbed.experiment import preset_settings

    def tup(values):
        return tuple(values) if values is not None else None

    return preset_settings(args.preset, arms=tup(args.arms), seeds=tup(args.seeds), probe_arms=tup(args.probe_arms),
                           steps=args.steps, ckpt_eval_every=args.ckpt_eval_every, task=args.task,
                           workers=args.workers, warm=args.warm)


def run(args: argparse.Namespace) -> int:
    from experiments.collapse_testbed.experiment import experiment_lock, run_experiment
    from experiments.collapse_testbed.pack import pack_experiment, unpack_experiment
    from experiments.collapse_testbed.results import summarize_experiment

    if args.build_warm_starts is not None:
        return build_warm(args)
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a directory")
    if args.tables_from is not None:
        return write_tables(load_results(args.tables_from), args)
    if args.pack_finished is not None:
        counts = pack_experiment(args.out, args.pack_finished, finished_only=True)
        print(json.dumps({"pack": str(args.pack_finished), **counts}))
        return 0
    if args.unpack is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with experiment_lock(args.out, doing="unpack into it"):
            unpack_experiment(args.unpack, args.out)
    if not args.summarize_only:
        run_experiment(args.out, settings_from_args(args), progress=not args.no_progress)
    if not (args.out / "runs").is_dir():
        raise ValueError(f"no runs in {args.out}")
    # under the lock: a summary taken while an experiment writes would mix finished and half-written runs
    with experiment_lock(args.out, doing="summarize"):
        res = summarize_experiment(args.out)
        write_tables(res, args)
        if args.pack is not None:
            pack_experiment(args.out, args.pack)
    return 0


def build_warm(args: argparse.Namespace) -> int:
    """``--build-warm-starts``: build the missing shipped warm starts; print each one's files and SHA-256."""
    from experiments.collapse_testbed.shipped import WARM_STARTS, build_warm_starts

    names = args.build_warm_starts or list(WARM_STARTS)
    manifest = build_warm_starts(names, force=args.force, progress=not args.no_progress)
    print(json.dumps({n: {"bytes": manifest[n]["bytes"], "files": manifest[n]["files"]} for n in names}, indent=1))
    return 0


def write_tables(res: dict, args: argparse.Namespace) -> int:
    """``results.md`` (and ``figures/`` unless ``--no-figures``) of ``res`` into ``--out``; print the tables."""
    from experiments.collapse_testbed.report import plot_results, results_markdown

    args.out.mkdir(parents=True, exist_ok=True)
    md = results_markdown(res)
    (args.out / "results.md").write_text(md + "\n")
    figures = [] if args.no_figures else plot_results(res, args.out / "figures")
    print(md)
    print(json.dumps({"results": str(args.out / "results.md"), "figures": [str(f) for f in figures]}, indent=1))
    return 0


def load_results(path: Path) -> dict:
    """A ``results.json`` object from ``path`` (plain or gzipped): the object itself, or the ``results.json``
    entry of a pack (a JSON object of files)."""
    import gzip

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a (gzipped) JSON file ({e})") from None
    if isinstance(data, dict) and "results.json" in data:
        data = data["results.json"]
        data = json.loads(data) if isinstance(data, str) else data
    if not isinstance(data, dict) or "arms" not in data:
        raise ValueError(f"{path}: holds no experiment results (a results.json object with 'arms')")
    return data


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option for a value no experiment can use, before any work (an experiment started
    from a negative step count would otherwise run the preset's full default into ``--out``)."""
    if args.build_warm_starts is None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a directory")
    check_at_least((("--steps", args.steps, 1), ("--workers", args.workers, 1),
                    ("--ckpt-eval-every", args.ckpt_eval_every, 0)))
    check_seeds(args.seeds)
    for flag, path in (("--unpack", args.unpack), ("--tables-from", args.tables_from)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if args.pack is not None and args.pack.is_dir():
        raise ValueError(f"--pack {args.pack} is a directory, not a file")


def main(argv: list[str] | None = None) -> int:
    bound_kernel_caches()  # first: oneDNN reads its cache sizes once (meshrl.kernel_caches)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
        return run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
