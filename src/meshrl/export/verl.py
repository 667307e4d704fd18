"""``meshrl export verl``: a task (and coach prefixes) as verl's RL parquet plus a reward module verl can load.

verl's ``RLHFDataset`` (``verl/utils/dataset/rl_dataset.py``, 0.9.1) reads parquet rows with a chat-format
``prompt`` (a list of ``{"role", "content"}`` messages), ``data_source``, ``reward_model.ground_truth`` and a free
``extra_info`` dict that verl carries into every rollout of the row (and into the reward function's call).
One row is written per query x coach prefix, as the authors' verl release lays its data out: verl gives each row
its own ``uid``, so GRPO normalises advantages inside each prefix group of ``rollout.n`` rollouts (meshrl's
``mesh.adv_unit=prefix_group``), and ``rollout.n = G / m`` gives the ``matched`` budget (G rollouts per query).
The prefix is wrapped in meshrl's anti-hacking template (``--template wrapped``) and placed in the system message,
the question (with the task's answer-format instruction) in the user message: the prompts meshrl's trainer builds
for ``mesh.placement=system``. ``extra_info`` holds ``query_id`` (the problem id), ``strategy_id`` (prefix index;
-1 without prefixes), ``num_strategies`` (m; 0 without prefixes), ``split`` and ``index``: the ``meshrl`` trainer
mode balances strategies by these ids and counts queries whose m rows a step did not hold together.

Files written to ``--out``: ``train.parquet``, ``val.parquet`` (the held-out split, without prefixes, as meshrl
evaluates), ``reward.py`` (``compute_score`` for ``reward.custom_reward_function``) and ``export.json`` (what was
written and the verl overrides that read it). Needs pyarrow, not verl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from meshrl.export.args import add_task_data
from meshrl.mesh import prefixes_by_problem, wrap_prefix
from meshrl.mesh.coach import TEMPLATES
from meshrl.runs import check_out_dir
from meshrl.tasks import load_task

REWARD_MODULE = '''"""verl reward function for the data in this folder; written by `meshrl export verl`.

verl: reward.custom_reward_function.path={path} reward.custom_reward_function.name=compute_score
"""

from meshrl.integrations.verl.reward import TaskScorer

compute_score = TaskScorer(task={task!r}, seed={seed!r})
'''


def _messages(task: Any, problem: Any, prefix: str | None, template: str) -> list[dict[str, str]]:
    user = {"role": "user", "content": task.format_prompt(problem)}
    if prefix is None:
        return [user]
    system = prefix if template == "plain" else wrap_prefix(prefix, "system")
    return [{"role": "system", "content": system}, user]


def _row(task: Any, problem: Any, split: str, strategy: int, prefix: str | None, template: str,
         index: int, m: int) -> dict[str, Any]:
    return {
        "data_source": f"meshrl/{task.name}",
        "prompt": _messages(task, problem, prefix, template),
        "ability": task.reward_kind,
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"query_id": problem.id, "strategy_id": strategy, "num_strategies": m, "split": split,
                       "index": index},
    }


def prefixes_for(problems: list[Any], path: Path, m: int) -> dict[str, list[str]]:
    """Problem id -> its first ``m`` prefixes from a ``meshrl coach`` file; every problem must have ``m``."""
    if not path.is_file():
        raise ValueError(f"prefix file not found: {path}")
    out, missing = prefixes_by_problem(path, problems, m)
    if missing:
        raise ValueError(f"prefix file {path}: {len(missing)} of {len(problems)} problems have no {m} prefixes "
                         f"(first: {', '.join(missing[:5])}); was it made by `meshrl coach` for this task?")
    return out


def export_rows(task: Any, problems: list[Any], split: str, prefixes: dict[str, list[str]] | None,
                template: str = "wrapped") -> list[dict[str, Any]]:
    """verl rows: one per problem x prefix (query-major order), or one per problem when ``prefixes`` is None."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
    rows: list[dict[str, Any]] = []
    for p in problems:
        chosen = [(-1, None)] if prefixes is None else list(enumerate(prefixes[p.id]))
        for k, prefix in chosen:
            rows.append(_row(task, p, split, k, prefix, template, len(rows), 0 if prefixes is None else len(chosen)))
    return rows


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def export_verl(task_spec: str, out_dir: str | Path, *, prefixes: str | Path | None = None, m: int = 4,
                template: str = "wrapped", seed: int = 0, split: str = "train",
                val_split: str | None = "eval") -> dict[str, Any]:
    """Write ``train.parquet``, ``val.parquet`` (unless ``val_split`` is None), ``reward.py`` and ``export.json``.

    Returns the summary written to ``export.json``. ``m`` must be >= 1 (prefixes per query); without ``prefixes``
    the rows are bare queries (the GRPO baseline's data, ``strategy_id = -1``).
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"--m must be an integer >= 1, got {m!r}")
    out = check_out_dir(out_dir)
    task = load_task(task_spec, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    problems = task.problems(split)
    if not problems:
        raise ValueError(f"task {task_spec!r} has no problems in split {split!r}")
    table = None if prefixes is None else prefixes_for(problems, Path(prefixes), m)
    train = export_rows(task, problems, split, table, template)
    _write_parquet(train, out / "train.parquet")
    files = {"train": str((out / "train.parquet").resolve())}
    if val_split is not None:
        val = export_rows(task, task.problems(val_split), val_split, None, template)
        _write_parquet(val, out / "val.parquet")
        files["val"] = str((out / "val.parquet").resolve())
    reward_path = (out / "reward.py").resolve()
    reward_path.write_text(REWARD_MODULE.format(path=reward_path, task=task_spec, seed=seed))
    summary = {
        "task": task_spec, "seed": seed, "split": split, "val_split": val_split, "queries": len(problems),
        "m": None if table is None else m, "template": template, "rows": len(train), "files": files,
        "reward_module": str(reward_path),
        "verl_overrides": [
            f"data.train_files={files['train']}",
            f"data.val_files={files.get('val', files['train'])}",
            f"reward.custom_reward_function.path={reward_path}",
            "reward.custom_reward_function.name=compute_score",
        ],
    }
    (out / "export.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _run(args: argparse.Namespace) -> int:
    val = None if args.val_split in ("", "none") else args.val_split
    summary = export_verl(args.task, args.out, prefixes=args.prefixes, m=args.m, template=args.template,
                          seed=args.seed, split=args.split, val_split=val)
    per = f" ({summary['queries']} queries x {summary['m']} prefixes)" if summary["m"] else ""
    print(f"wrote {summary['rows']} rows{per} to {summary['files']['train']}")
    print("verl overrides:\n  " + "\n  ".join(summary["verl_overrides"]))
    return 0


def add_export_parser(export_subparsers: argparse._SubParsersAction) -> None:
    """Add ``verl`` to the ``meshrl export`` sub-commands (sets ``func``)."""
    p = export_subparsers.add_parser(
        "verl", help="write a task (x coach prefixes) as verl parquet + reward module",
        description="Write verl's RL parquet (one row per query x coach prefix, chat-format prompt, data_source, "
                    "reward_model.ground_truth, extra_info with query_id/strategy_id) and a reward module for "
                    "reward.custom_reward_function.")
    add_task_data(p, prefixes_required=False,
                  prefixes_help="prefixes.jsonl from `meshrl coach` (omit for the GRPO baseline's bare queries)")
    p.add_argument("--val-split", default="eval", help="held-out split for val.parquet ('none' to skip)")
    p.set_defaults(func=_run)
