"""Sampled evaluation: n samples per problem, strict grading, mean@k and unbiased pass@k.

Every sample is written to ``eval_samples.jsonl`` with its extracted answer and verdict, so results can
be re-graded without re-sampling; the summary goes to ``eval.json``. Grading uses the task's reward kind
(``kind=`` in the spec) unless ``kind`` is given (``meshrl eval --kind``); the summary records the kind
and the instruction. Problems whose prompt leaves no room for ``max_new_tokens`` in the model's positions
are skipped, logged and listed in the summary (``skipped_long_prompts``). Problems are processed in fixed
chunks whose sampling seed depends only on the chunk index, so an interrupted evaluation resumes where it
stopped and gives the same samples as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshrl.jsonl import JsonlWriter, atomic_write_text, read_jsonl
from meshrl.progress import progress_bar
from meshrl.runs.correct import is_correct
from meshrl.trainer import PromptBudget, context_limit

log = logging.getLogger("meshrl")


@dataclass
class EvalConfig:
    model: str
    data: str
    n: int = 4
    ks: list[int] = field(default_factory=lambda: [1])
    split: str = "all"
    limit: int | None = None
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chunk_size: int = 8  # problems per generate call
    by: str | None = None  # meta field to break results down by (e.g. "type", "level")
    backend: str = "auto"  # rollout backend: auto (native for Llama-family models, else hf) | hf | native
    kind: str | None = None  # reward kind to grade with (None: the task's own)

    def validate(self) -> EvalConfig:
        checks = {"--n": (self.n, self.n >= 1, ">= 1"),
                  "--limit": (self.limit, self.limit is None or self.limit >= 1, ">= 1"),
                  "--max-new-tokens": (self.max_new_tokens, self.max_new_tokens >= 1, ">= 1"),
                  "--temperature": (self.temperature, self.temperature >= 0, ">= 0"),
                  "--top-p": (self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
                  "chunk_size": (self.chunk_size, self.chunk_size >= 1, ">= 1")}
        for name, (value, ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {value}")
        if not self.ks:
            raise ValueError("--k needs at least one value")
        bad = [k for k in self.ks if k < 1 or k > self.n]
        if bad:
            raise ValueError(f"--k values {bad} must be between 1 and --n {self.n}")
        return self


def summarize(rows: list[dict[str, Any]], ks: list[int], by: str | None = None) -> dict[str, Any]:
    """Per-problem (n, c) from sample rows -> mean@k / pass@k overall and per ``by`` group.

    mean@k is the expected accuracy of one sample estimated from the first k samples of each problem
    (averaged over problems); pass@k is the unbiased estimator of Chen et al. (2021).
    """
    from meshrl.stats import pass_at_k

    per_problem: dict[str, list[float]] = defaultdict(list)
    group_of: dict[str, str] = {}
    for r in sorted(rows, key=lambda r: (r["problem_id"], r["sample"])):
        per_problem[r["problem_id"]].append(float(r["correct"]))
        if by is not None:
            group_of[r["problem_id"]] = str(r.get("group", "?"))

    def block(ids: list[str]) -> dict[str, float]:
        out: dict[str, float] = {"problems": float(len(ids))}
        for k in ks:
            out[f"mean@{k}"] = sum(sum(per_problem[i][:k]) / k for i in ids) / len(ids)
            out[f"pass@{k}"] = sum(pass_at_k(len(per_problem[i]), int(sum(per_problem[i])), k)
                                   for i in ids) / len(ids)
        return out

    ids = sorted(per_problem)
    summary: dict[str, Any] = {"overall": block(ids) if ids else {"problems": 0.0}}
    if by is not None:
        groups: dict[str, list[str]] = defaultdict(list)
        for i in ids:
            groups[group_of[i]].append(i)
        summary["by"] = {"field": by, "groups": {g: block(v) for g, v in sorted(groups.items())}}
    summary["per_problem"] = {i: {"n": len(v), "c": int(sum(v))} for i, v in per_problem.items()}
    return summary


def _check_code_sandbox(task: Any) -> None:
    """A code task refuses, before loading the model, to run model-written code under a weak sandbox unless
    ``MESHRL_SANDBOX_ALLOW_WEAK=1`` accepts the risk (one line, docs/reliability.md)."""
    from meshrl.rewards.sandbox import check_sandbox
    from meshrl.tasks import CodeTask

    if isinstance(task, CodeTask):
        log.info("code sandbox: %s", check_sandbox())


def run_eval(cfg: EvalConfig, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Sample, grade and summarise; resumes from ``out_dir/eval_samples.jsonl`` when present."""
    from meshrl.agents.environment import count_reward_failures
    from meshrl.models import encode_prompt
    from meshrl.rewards import RewardRunner, scorer_time_limit
    from meshrl.rewards.grading import extract_for_kind
    from meshrl.rollout import SamplingParams, make_backend
    from meshrl.tasks import load_task
    from meshrl.trainer import encode_within_limit, generate_scored, load_policy

    cfg.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.data, seed=cfg.seed)
    if cfg.kind is not None:
        from meshrl.tasks import with_kind

        task = with_kind(task, cfg.kind)
    _warn_on_training_mismatch(cfg, task)
    _check_code_sandbox(task)
    problems = task.problems(cfg.split)[: cfg.limit] if cfg.limit else task.problems(cfg.split)
    if not problems:
        raise ValueError(f"{cfg.data} split {cfg.split!r} has no problems")
    if cfg.by is not None and not any(cfg.by in p.meta for p in problems):
        fields = sorted({k for p in problems for k in p.meta})
        raise ValueError(f"--by {cfg.by}: no problem of {cfg.data} has this field; fields: {', '.join(fields)}")
    samples_path = out_dir / "eval_samples.jsonl"
    model, tok, desc = load_policy(cfg.model, seed=cfg.seed)
    provenance = eval_provenance(cfg, model)
    check_provenance(out_dir, provenance)
    done_rows = _valid_rows(samples_path, cfg)
    done_ids = {r["problem_id"] for r in done_rows}
    atomic_write_text(out_dir / PROVENANCE, json.dumps(provenance, indent=1) + "\n")
    budget = PromptBudget(context_limit(model, tok), cfg.max_new_tokens, "--max-new-tokens")
    backend = make_backend(cfg.backend, model, tok, batch_size=cfg.chunk_size * cfg.n)
    runner = RewardRunner(task.score, timeout_s=scorer_time_limit(10.0, task))
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            n=cfg.n)
    chunks = [problems[i : i + cfg.chunk_size] for i in range(0, len(problems), cfg.chunk_size)]
    prompt_encoder = task.encode_prompt if getattr(task, "episodic", False) else encode_prompt  # tools shown
    all_episodes: list[Any] = []
    writer = JsonlWriter(samples_path)
    t0 = time.perf_counter()
    try:
        with progress_bar("eval", len(chunks), progress) as advance:
            for ci, chunk in enumerate(chunks):
                if all(p.id in done_ids for p in chunk):
                    advance()
                    continue
                encoded = [(p, encode_within_limit(prompt_encoder, tok, task.format_prompt(p), budget.limit))
                           for p in chunk]
                encoded = [(p, ids) for p, ids in encoded if budget.fits(p.id, len(ids))]
                if not encoded:
                    advance()
                    continue
                texts, probs, scores, truncated, episodes = generate_scored(
                    task, backend, tok, [ids for _, ids in encoded], [p for p, _ in encoded], params,
                    cfg.seed * 1_000_003 + ci, runner,
                    lambda i, obs, enc=encoded: prompt_encoder(tok, task.format_prompt(enc[i][0]) + obs))
                all_episodes.extend(episodes)  # a tool-using task's (turns, tool calls, errors)
                # an environment's failed get_reward scored 0: counted beside the grader's errors
                count_reward_failures([e.env_reward for e in episodes], runner)
                counts: dict[str, int] = defaultdict(int)
                for text, prob, score, trunc in zip(texts, probs, scores, truncated, strict=True):
                    row = {"problem_id": prob.id, "sample": counts[prob.id], "completion": text,
                           "extracted": extract_for_kind(text, task.reward_kind), "reference": prob.answer,
                           "score": score,
                           "correct": is_correct(score), "truncated": bool(trunc)}
                    if cfg.by is not None:
                        row["group"] = prob.meta.get(cfg.by, "?")
                    counts[prob.id] += 1
                    if prob.id not in done_ids:
                        writer.write(row)
                        done_rows.append(row)
                advance()
    finally:
        writer.close()
    if len(budget.too_long) == len(problems):
        raise ValueError(f"{cfg.data}: every problem's prompt is too long for the model ({budget.limit} positions "
                         f"with --max-new-tokens {cfg.max_new_tokens}); nothing was evaluated")
    wanted = {p.id for p in problems} - set(budget.too_long)
    summary = summarize([r for r in done_rows if r["problem_id"] in wanted], cfg.ks, cfg.by)
    reward_stats = runner.pop_stats()
    summary.update({"config": asdict(cfg), "model_loaded": desc, "provenance": provenance,
                    "reward_stats": reward_stats,
                    "reward_kind": task.reward_kind, "instruction": task.instruction,
                    "skipped_long_prompts": dict(budget.too_long), "seconds": time.perf_counter() - t0})
    if all_episodes:  # of the episodes drawn in this call (a resumed evaluation: the new ones only)
        from meshrl.agents import episode_metrics

        summary["episodes"] = episode_metrics(all_episodes)
    unscored = unscored_note(reward_stats, runner.last_failure)
    if unscored is not None:
        summary["unscored"] = unscored
        log.warning("%s", unscored["message"])
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=1))
    return summary


def unscored_note(reward_stats: dict[str, int], last_failure: str | None) -> dict[str, Any] | None:
    """What this evaluation could not score (``None``: it scored every sample): its counts and a one-line
    message. Such a sample scored 0 and counts as wrong, so mean@k and pass@k are lower bounds."""
    errors, timeouts = int(reward_stats.get("reward/errors", 0)), int(reward_stats.get("reward/timeouts", 0))
    if not errors and not timeouts:
        return None
    message = (f"{errors + timeouts} reward(s) could not be scored ({errors} errors, {timeouts} timeouts): each "
               "scored 0 and counts as wrong, so mean@k and pass@k are lower bounds"
               + (f"; last: {last_failure}" if last_failure else ""))
    return {"errors": errors, "timeouts": timeouts, "last": last_failure, "message": message}


def trained_task(model: str) -> dict[str, Any] | None:
    """The task a run directory (or one of its checkpoints) was trained on, as its config.yaml resolved it
    (``name``, ``reward_kind``, ``instruction``), or ``None``."""
    import yaml

    from meshrl.runs import is_run_dir

    path = Path(model)
    if path.name.startswith("step_"):
        path = path.parent.parent
    if not is_run_dir(path):
        return None
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return None  # load_policy reports a broken config.yaml itself
    resolved = saved.get("resolved_task") if isinstance(saved, dict) else None
    return resolved if isinstance(resolved, dict) else None


def trained_kind(model: str) -> str | None:
    """The reward kind a run directory (or one of its checkpoints) was trained with, from its config.yaml."""
    resolved = trained_task(model)
    return resolved.get("reward_kind") if resolved else None


def _warn_on_training_mismatch(cfg: EvalConfig, task) -> None:
    """Say so when a run trained under one reward kind is graded under another (e.g. last_number vs number),
    and when its training prompts ended with another answer-format instruction (``--kind`` changes only the
    grading: a run trained on ``kind=last_number`` prompts is then asked for a ``\\boxed{}`` answer)."""
    trained = trained_task(cfg.model)
    if trained is None:
        return
    kind = trained.get("reward_kind")
    if kind is not None and kind != task.reward_kind and cfg.kind is None:
        log.warning("%s was trained with reward kind %r but %s grades with %r; pass --kind %s to grade as in "
                    "training", cfg.model, kind, cfg.data, task.reward_kind, kind)
    if "instruction" in trained and trained["instruction"] != task.instruction:
        log.warning("%s was trained on prompts ending with the instruction %r but %s's prompts end with %r: the "
                    "scores are for other prompts than training's; give the data spec the options of training "
                    "(e.g. ?kind=%s, or instruction=...)", cfg.model, trained["instruction"], cfg.data,
                    task.instruction, kind)


def _valid_rows(path: Path, cfg: EvalConfig) -> list[dict[str, Any]]:
    """Rows of problems that already have all ``n`` samples (partial problems are re-sampled)."""
    if not path.is_file():
        return []
    rows = read_jsonl(path)
    count: dict[str, int] = defaultdict(int)
    for r in rows:
        count[r["problem_id"]] += 1
    keep = [r for r in rows if count[r["problem_id"]] == cfg.n]
    if len(keep) != len(rows):  # atomic: a kill inside the rewrite leaves the old file, never a short one
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
    return keep


PROVENANCE = "eval_provenance.json"
# What decides the samples (chunk_size too: a chunk's sampling seed is its index); not --limit, --k or --by.
SAMPLING_FIELDS = ("data", "split", "n", "max_new_tokens", "temperature", "top_p", "seed", "chunk_size", "backend",
                   "kind")


def weights_sha256(model: Any) -> str:
    """SHA-256 over the model's tensors (names, dtypes, shapes and bytes, in name order): which weights these are,
    whatever file or spec they came from (about 1 s per 500 MB)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def eval_provenance(cfg: EvalConfig, model: Any) -> dict[str, Any]:
    """What produced an OUT's samples: the weights' hash and the settings that decide the samples."""
    return {"weights_sha256": weights_sha256(model), "model": cfg.model,
            **{k: getattr(cfg, k) for k in SAMPLING_FIELDS}}


def check_provenance(out_dir: Path, provenance: dict[str, Any]) -> None:
    """Refuse to reuse samples in ``out_dir`` that another evaluation (other weights or settings) produced, or
    that carry no record of what produced them; a one-line error that says how to start fresh."""
    samples = out_dir / "eval_samples.jsonl"
    if not samples.is_file() or not samples.read_bytes().strip():
        return
    fresh = f"choose another --out, or delete {samples} to start this evaluation afresh"
    path = out_dir / PROVENANCE
    try:
        recorded = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--out {out_dir} holds samples without a record of what produced them ({path} is "
                         f"missing: an older meshrl, or not an evaluation of this one); {fresh}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e}); {fresh}") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path} does not hold an object; {fresh}")
    differ = [k for k in provenance if k != "model" and recorded.get(k) != provenance[k]]
    if differ:
        shown = "; ".join(f"{k} {recorded.get(k)!r} there, {provenance[k]!r} now" for k in differ[:4])
        what = "another model's weights" if "weights_sha256" in differ else "other settings"
        raise ValueError(f"--out {out_dir} holds samples of {what} ({shown}); {fresh}")
