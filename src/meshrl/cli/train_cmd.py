"""``meshrl train``: run or resume a GRPO-family training run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from meshrl.algos import RECIPES
from meshrl.trainer import MESH_RECIPES

HELP = """Train a policy with a recipe on a task. Precedence: built-in defaults < --config file <
explicit flags < --set overrides. Every resolved setting is written to RUN_DIR/config.yaml."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run or resume a training run", description=HELP)
    p.add_argument("--recipe", choices=sorted([*RECIPES, *MESH_RECIPES]),
                   help="algorithm preset (default grpo); mesh / cp_only add coach prefixes (see mesh.* keys)")
    p.add_argument("--model", help="tiny | tiny:small | smollm2-135m | path to a local HF model directory")
    p.add_argument("--task", help="tiny:repeat | tiny:add | rg:NAME | jsonl:PATH | parquet:PATH | math500 | gsm8k")
    p.add_argument("--steps", type=int, help="total training steps (with --resume: continue to this total)")
    p.add_argument("--out", type=Path, help="run directory (config, metrics, samples, checkpoints)")
    p.add_argument("--config", type=Path, help="YAML file with any RunConfig keys")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-5 --set algo.clip_high=0.28 (repeatable)")
    p.add_argument("--seed", type=int, help="seed for weights init, problem order and sampling")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--report-to", help="comma list of trackers: tensorboard,wandb,trackio")
    p.add_argument("--strict-rewards", action="store_true", help="abort on a reward-function error or timeout")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--help-config", action="store_true",
                   help="print every config key (type, default, allowed values, help) and exit; with --markdown, "
                        "the text of docs/config.md")
    p.add_argument("--markdown", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    out = []
    for key in ("recipe", "model", "task", "steps", "seed"):
        value = getattr(args, key)
        if value is not None:
            out.append(f"{key}={value}")
    if args.report_to:
        out.append(f"log.report_to=[{args.report_to}]")
    if args.strict_rewards:
        out.append("reward.strict=true")
    if args.no_progress:
        out.append("log.progress=false")
    return out + list(args.overrides)


def _resume_config(run_dir: Path, args: argparse.Namespace):
    from meshrl.trainer import load_config

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ValueError(f"--resume {run_dir}: no config.yaml there (not a meshrl run directory)")
    if args.config is not None or args.recipe or args.model or args.task:
        raise ValueError("--resume takes the run's own config; only --steps and --set may change it")
    try:  # the file alone first, so that its own faults name it (the trainer writes it atomically)
        load_config(cfg_file)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume {run_dir}: {cfg_file} is corrupt ({' '.join(str(e).split())})") from e
    except ValueError as e:
        raise ValueError(f"--resume {run_dir}: {cfg_file}: {e}") from e
    return load_config(cfg_file, _flag_overrides(args))


def _stopped(err: BaseException, prefix: str = "") -> int:
    """One line (rc 1) for a run that stopped before its last step, with the checkpoint it can continue from."""
    ckpt = getattr(err, "checkpoint", None)
    where = f"; checkpoint saved: {ckpt}" if ckpt else ""
    text = " ".join(str(err).split()) or type(err).__name__
    print(f"meshrl train: error: {prefix}{text}{where}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    from meshrl.rewards import RewardError
    from meshrl.trainer import HealthStop, NonFiniteAbort, RewardsFailed, RunInterrupted, StalledRun, load_config, train

    if args.help_config:
        from meshrl.trainer import config_reference

        sys.stdout.write(config_reference(markdown=args.markdown))
        return 0
    if args.resume is not None:
        run_dir = args.resume
        if not run_dir.is_dir():
            raise ValueError(f"--resume {run_dir}: no such run directory")
        cfg = _resume_config(run_dir, args)
        resume = True
    else:
        if args.out is None:
            raise ValueError("--out RUN_DIR is required (or --resume RUN_DIR)")
        run_dir = args.out
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"--out {run_dir} is a file, not a directory; give a new or existing directory")
        cfg = load_config(args.config, _flag_overrides(args))
        resume = False
    try:
        history = train(cfg, run_dir, resume=resume)
    except RunInterrupted as err:
        print(f"meshrl train: {err}; continue with: meshrl train --resume {run_dir}", file=sys.stderr)
        return 128 + err.signum
    except (NonFiniteAbort, StalledRun, HealthStop, RewardsFailed) as err:
        return _stopped(err)
    except RewardError as err:
        return _stopped(err, prefix="reward function failed (reward.strict / --strict-rewards): ")
    if history:
        last = history[-1]
        print(f"done: step {last['step']} reward/mean {last.get('reward/mean', float('nan')):.4f} "
              f"acc/mean {last.get('acc/mean', float('nan')):.4f}; run directory {run_dir}", file=sys.stderr)
    return 0
