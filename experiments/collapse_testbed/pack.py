"""The compact per-run data of a testbed experiment: enough to rebuild its tables without rerunning it.

``pack_experiment(out, path)`` writes one gzipped JSON object keyed by the file's path inside ``out``
(``settings.json``, ``baseline_probes.jsonl``, ``runs/ARM/seed_S/metrics.jsonl`` ...): every run's training
metrics, probes (per problem: only what the MEI-vs-truth table reads), final evaluation (``eval.json`` and the
samples' problem, type and completion), checkpoint evaluations, compute record and config. Not the weights, and
not the training rollouts (``samples.jsonl``, tens of MB): the two per-step series the tables read from those
(the true per-problem max strategy share of the training rollouts, and the coach-following shares) are stored in
their place as ``derived.json``.
``unpack_experiment(path, out)`` writes the files back, and ``python -m experiments.collapse_testbed --out DIR
--summarize-only`` then rebuilds every table (README.md).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

TOP_FILES = ("settings.json", "baseline_probes.jsonl", "results.json")
RUN_FILES = ("metrics.jsonl", "events.jsonl", "probes.jsonl", "done.json", "config.yaml", "eval/eval.json")
SAMPLE_FIELDS = ("problem_id", "group", "completion")  # what the tables read from eval_samples.jsonl


def _keep_probe_field(key: str) -> bool:
    """What ``mei_vs_truth`` and the MEI analysis of the persistence experiment read from a per-problem probe
    record (MEI over all and over the distinct rollouts, per query)."""
    return (key in ("step", "probe_seed", "id", "true_strategies", "distinct_frac")
            or key.startswith(("mei/", "mei_distinct/", "eff_dirs/")))


def _trimmed(path: Path, keep) -> str:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows.append(json.dumps({k: v for k, v in r.items() if keep(k)}))
    return "".join(x + "\n" for x in rows)


def pack_experiment(out: Path, path: Path, *, finished_only: bool = False) -> dict[str, int]:
    """Write ``path`` (gzipped JSON) from experiment directory ``out``; return ``{"runs": n, "files": m}``.
    Symlinked run directories (an experiment assembled from several) are followed. ``finished_only``: only the runs
    whose ``done.json`` exists (written last), so that a partial pack can be taken while the experiment runs."""
    from experiments.collapse_testbed.experiment import aborted
    from experiments.collapse_testbed.results import DERIVED, _training_truth, coach_following_run, experiment_task

    task = experiment_task(out)
    files: dict[str, str] = {}
    for name in TOP_FILES:
        if (out / name).is_file():
            files[name] = (out / name).read_text()
    for ev in sorted(out.glob("warm_eval/seed_*/eval.json")):  # the step-0 points of the niche curves
        files[str(ev.relative_to(out))] = ev.read_text()
    if (out / "baseline_per_problem.jsonl").is_file():
        files["baseline_per_problem.jsonl"] = _trimmed(out / "baseline_per_problem.jsonl", _keep_probe_field)
    # a run the trainer aborted has no evaluation but is a result: packed, so its pack names it too
    runs = sorted(d for d in (out / "runs").glob("*/seed_*") if ((d / "eval" / "eval.json").is_file() or aborted(d))
                  and (not finished_only or (d / "done.json").is_file()))
    for d in runs:
        rel = f"runs/{d.parent.name}/{d.name}"
        for name in RUN_FILES:
            if (d / name).is_file():
                files[f"{rel}/{name}"] = (d / name).read_text()
        if (d / "eval" / "eval_samples.jsonl").is_file():
            files[f"{rel}/eval/eval_samples.jsonl"] = _trimmed(d / "eval" / "eval_samples.jsonl",
                                                               lambda k: k in SAMPLE_FIELDS)
        if (d / "probes_per_problem.jsonl").is_file():
            files[f"{rel}/probes_per_problem.jsonl"] = _trimmed(d / "probes_per_problem.jsonl", _keep_probe_field)
        for ev in sorted(d.glob("ckpt_eval/step_*/eval.json")):
            files[f"{rel}/{ev.relative_to(d)}"] = ev.read_text()
        if (d / "samples.jsonl").is_file():
            derived = {"training_truth": _training_truth(d, task),
                       "coach_following": coach_following_run(out, d.parent.name, int(d.name.split("_")[1]), d, task)}
            files[f"{rel}/{DERIVED}"] = json.dumps(derived)
        elif (d / DERIVED).is_file():  # a run unpacked from a pack
            files[f"{rel}/{DERIVED}"] = (d / DERIVED).read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        json.dump(files, fh)
    return {"runs": len(runs), "files": len(files)}


def unpack_experiment(path: Path, out: Path) -> dict[str, Any]:
    """Write the files of pack ``path`` under ``out`` (refusing a path that leaves it); return the settings."""
    with gzip.open(path, "rt") as fh:
        files = json.load(fh)
    if not isinstance(files, dict):
        raise ValueError(f"{path}: not a meshrl experiment pack (a JSON object of files)")
    root = out.resolve()
    for rel, text in files.items():
        target = (out / rel).resolve()
        if root not in target.parents:
            raise ValueError(f"{path}: entry {rel!r} points outside {out}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return json.loads(files.get("settings.json", "{}"))
