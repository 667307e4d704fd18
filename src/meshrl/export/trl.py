"""``meshrl export trl``: the dataset a TRL GRPO run reads for Mesh Learning, from a task and a prefix file.

Does not import trl (the meshrl CLI works without it). Writes, under ``--out DIR``:

- ``train.jsonl`` (``--layout query``, the default, read by :class:`MeshGRPOTrainer`): one row per query
  with ``prompt`` (conversational: the task's user message), ``problem`` (the text the prefix file is
  keyed by), ``answer``, ``query_id``, ``query_key``, ``prefixes`` (its m coach prefixes),
  ``strategy_ids`` (0..m-1, the ids completions carry) and ``strategy_names``;
- or (``--layout query_prefix``) one row per query x prefix, ``prompt`` already conditioned on the prefix
  (``--placement system``, anti-hacking template unless ``--template plain``) with ``query_id`` and
  ``strategy_id``: Coach Prompting in a plain ``GRPOTrainer`` (advantages per prefix group; no balancing,
  which needs every rollout of a query in one step);
- ``meta.json``: task, split, m, layout, prefix file, row counts, template version.

:func:`meshrl.integrations.trl.reward.task_reward_func` turns the same task into a TRL reward function (the task's
own scorer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from meshrl.export.args import add_task_data
from meshrl.mesh.coach import (
    PLACEMENTS,
    TEMPLATE_VERSION,
    check_conditioning,
    condition_prompt,
    load_prefix_records,
    query_key,
)
from meshrl.runs import check_out_dir
from meshrl.tasks import load_task

LAYOUTS = ("query", "query_prefix")


def export_rows(task, problems, table: dict[str, list[str]], m: int, *, layout: str = "query",
                placement: str = "system", template: str = "wrapped", names: dict[str, list[str]] | None = None,
                prefix_file: str = "prefixes") -> list[dict[str, Any]]:
    """Dataset rows for TRL; ``ValueError`` naming ``prefix_file`` and the first problems without m prefixes."""
    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if layout == "query_prefix" and placement != "system":
        raise ValueError("--layout query_prefix supports --placement system only: an assistant-turn prefix needs "
                         "MeshGRPOTrainer (TRL renders prompts with a generation prompt after the last message)")
    check_conditioning(m, placement, template)  # as MeshGRPOTrainer's MeshOptions checks them
    missing = [p.id for p in problems if len(table.get(query_key(p.prompt), ())) < m]
    if missing:
        raise ValueError(f"{len(missing)} of {len(problems)} problems of task {task.name} have no {m} prefixes in "
                         f"prefix file {prefix_file} (first: {', '.join(map(str, missing[:5]))}); run `meshrl coach "
                         f"--task {task.name} --m {m}` or check --task/--split")
    rows = []
    for p in problems:
        key = query_key(p.prompt)
        prefixes = list(table[key][:m])
        prompt = [{"role": "user", "content": task.format_prompt(p)}]
        base = {"problem": p.prompt, "answer": p.answer, "query_id": str(p.id), "query_key": key}
        if layout == "query":
            strategy_names = list((names or {}).get(key, [""] * m))[:m]
            rows.append({"prompt": prompt, **base, "prefixes": prefixes, "strategy_ids": list(range(m)),
                         "strategy_names": strategy_names + [""] * (m - len(strategy_names))})
        else:
            rows.extend({"prompt": condition_prompt(prompt, prefix, placement, template), **base, "strategy_id": k,
                         "prefix": prefix} for k, prefix in enumerate(prefixes))
    return rows


def export_trl(task_spec: str, prefixes: str | Path, out: str | Path, *, m: int = 4, split: str = "train",
               layout: str = "query", placement: str = "system", template: str = "wrapped", seed: int = 0,
               limit: int | None = None) -> dict[str, Any]:
    """Write ``OUT/train.jsonl`` (named after ``split`` when it is not ``train``) and ``OUT/meta.json``."""
    path = Path(prefixes)
    out_dir = check_out_dir(out)
    if not path.is_file():
        raise ValueError(f"--prefixes: prefix file not found: {path}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be an integer >= 1 (the first N problems), got {limit!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"--m must be an integer >= 1, got {m!r}")
    records = load_prefix_records(path)
    table, names = {}, {}
    for key, rec in records.items():
        if not isinstance(rec.get("prefixes"), list):
            raise ValueError(f"prefix file {path}: record {key[:12]} has no list of prefixes")
        table[key], names[key] = rec["prefixes"], rec.get("names") or []
    task = load_task(task_spec, seed=seed)
    problems = task.problems(split)
    if limit is not None:
        problems = problems[:limit]
    if not problems:
        raise ValueError(f"task {task_spec} has no problems in split {split!r}")
    rows = export_rows(task, problems, table, m, layout=layout, placement=placement, template=template, names=names,
                       prefix_file=str(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    data_path = out_dir / f"{split}.jsonl"
    with data_path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    meta = {"engine": "trl", "task": task_spec, "split": split, "seed": seed, "m": m, "layout": layout,
            "placement": placement if layout == "query_prefix" else None,
            "template_version": TEMPLATE_VERSION if template == "wrapped" else "plain",
            "prefix_file": str(path), "queries": len(problems), "rows": len(rows), "data": data_path.name,
            "reward_kind": task.reward_kind}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def add_export_parser(export_subparsers: argparse._SubParsersAction) -> None:
    """Add ``trl`` to the subcommands of ``meshrl export`` (sets ``func``)."""
    p = export_subparsers.add_parser(
        "trl", help="write the dataset for a TRL GRPO run with Mesh Learning",
        description="One row per query with its m coach prefixes and ids (for meshrl.integrations.trl."
                    "MeshGRPOTrainer), or one row per query x prefix with the prompt already conditioned "
                    "(--layout query_prefix, for a plain GRPOTrainer). Needs no trl.")
    add_task_data(p, prefixes_required=True)
    p.add_argument("--layout", choices=LAYOUTS, default="query")
    p.add_argument("--placement", choices=PLACEMENTS, default="system",
                   help="query_prefix layout: where the prefix goes (system only)")
    p.add_argument("--limit", type=int, help="first N problems only")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    meta = export_trl(args.task, args.prefixes, args.out, m=args.m, split=args.split, layout=args.layout,
                      placement=args.placement, template=args.template, seed=args.seed, limit=args.limit)
    print(f"wrote {meta['rows']} rows ({meta['queries']} queries x m={meta['m']}, layout {meta['layout']}) to "
          f"{Path(args.out) / meta['data']}")
    return 0
