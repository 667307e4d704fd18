"""Paired comparison of two evaluated models, benchmark by benchmark (``meshrl compare``).

An argument is an eval directory (``eval.json`` inside: one benchmark, named by its ``data`` spec) or a
folder of eval directories (one benchmark per sub-folder, named by the folder). Problems are paired by id:
the statistics resample problems, because samples of one problem are correlated.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("meshrl")


def load_eval_set(path: Path) -> dict[str, dict[str, Any]]:
    """``{benchmark: eval.json content}`` for an eval dir or a folder of eval dirs."""
    if (path / "eval.json").is_file():
        data = json.loads((path / "eval.json").read_text())
        return {str(data.get("config", {}).get("data", path.name)): data}
    subs = sorted(p for p in path.iterdir() if (p / "eval.json").is_file()) if path.is_dir() else []
    if not subs:
        raise ValueError(f"{path} is neither an eval directory (eval.json) nor a folder of eval directories")
    return {p.name: json.loads((p / "eval.json").read_text()) for p in subs}


def per_problem_scores(summary: dict[str, Any], metric: str) -> dict[str, float]:
    """Per-problem score: ``mean`` (c/n, the expected single-sample accuracy) or ``pass@k`` (unbiased)."""
    from meshrl.stats import pass_at_k

    out = {}
    for pid, nc in summary["per_problem"].items():
        n, c = int(nc["n"]), int(nc["c"])
        if metric == "mean":
            out[pid] = c / n
        else:
            k = int(metric.split("@", 1)[1])
            if k > n:
                raise ValueError(f"metric {metric} needs >= {k} samples per problem, problem {pid} has {n}")
            out[pid] = pass_at_k(n, c, k)
    return out


def compare_evals(path_a: Path, path_b: Path, *, metric: str = "mean", seed: int = 0, n_boot: int = 10000,
                  alpha: float = 0.05, correct: str = "bootstrap") -> list[Any]:
    """Rows of :func:`meshrl.stats.compare_table` for the benchmarks both sides evaluated."""
    from meshrl.stats import compare_table

    if metric != "mean" and not metric.startswith("pass@"):
        raise ValueError(f"--metric must be 'mean' or 'pass@K', got {metric!r}")
    set_a, set_b = load_eval_set(path_a), load_eval_set(path_b)
    common = [b for b in set_a if b in set_b]
    if not common:
        raise ValueError(f"{path_a} and {path_b} share no benchmark ({sorted(set_a)} vs {sorted(set_b)})")
    for b in sorted(set(set_a) ^ set(set_b)):
        log.warning("benchmark %s is evaluated on one side only; left out", b)
    scores_a, scores_b, ks = {}, {}, {}
    for bench in common:
        sa, sb = per_problem_scores(set_a[bench], metric), per_problem_scores(set_b[bench], metric)
        ids = sorted(set(sa) & set(sb))
        if len(ids) < len(sa) or len(ids) < len(sb):
            log.warning("%s: %d problems on A, %d on B, %d paired; the unpaired ones are left out",
                        bench, len(sa), len(sb), len(ids))
        if len(ids) < 2:
            raise ValueError(f"benchmark {bench}: fewer than 2 problems evaluated on both sides")
        scores_a[bench] = [sa[i] for i in ids]
        scores_b[bench] = [sb[i] for i in ids]
        ks[bench] = min(int(set_a[bench]["per_problem"][i]["n"]) for i in ids)
    return compare_table(scores_a, scores_b, samples_per_problem=ks, seed=seed, n_boot=n_boot, n_perm=n_boot,
                         alpha=alpha, correct=correct)
