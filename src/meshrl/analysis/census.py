"""Strategy census of logged rollouts (docs/method.md §1.1): how many strategies each query's rollouts still span.

Input rows (JSONL, e.g. a run's ``samples.jsonl`` or any file written the same way), one rollout each:

- ``prompt`` (str, required): the user text exactly as given to the chat template (the trainer writes
  ``task.format_prompt(problem)``); re-encoded with ``encode_prompt(tokenizer, prompt, system=system)``;
- ``completion`` (str, required): the decoded response;
- ``problem_id`` (str or int, required);
- ``step`` (optional, any JSON scalar; ``None`` when absent) and any other field named in ``group_key``;
- ``truncated`` (optional bool): when it is ``false`` the response ended with an eos token that
  decoding dropped, so ``eos_ids(model, tokenizer)[0]`` (the tokenizer's eos) is appended to the
  completion's tokens; when it is ``true`` or absent nothing is appended;
- ``system`` (optional str): a system prompt the rollout was sampled under (e.g. a wrapped coach prefix);
- ``prompt_ids`` and ``response_ids`` (optional, together; lists of token ids): the exact tokens, used instead
  of re-encoding ``prompt`` / ``completion`` (``truncated`` and ``system`` are then not read). The trainer
  writes them for multi-turn episodes (``env:`` tasks), with
- ``model_mask`` (optional, with the ids; 0/1 per response token): 1 on the tokens the model sampled, 0 on the
  environment's (tool output): the scores and sequence log-probs cover the model's tokens only, as the
  trainer's update does, while the forward still reads the tool output as context;
- ``strategy_label`` (optional str or null): a parser's strategy label (the trainer writes the task's
  ``label_strategy``: a procedure, or a tool pattern on a tool-using task). Where every rollout of a group
  has one, the group also reports the labels' masses and how well the geometric partition agrees with them.

Completion tokens are ``tokenizer.encode(completion, add_special_tokens=False)``: a re-tokenisation of
the decoded text, which can differ from the sampled ids where decoding is not invertible (special tokens
skipped by the decoder, non-canonical BPE splits). The census therefore measures the strategies of the
rollouts *as text* under ``model_spec``.

Rows missing a required field, or with a field of the wrong type, are skipped, counted and logged (one
line each, with the file's line number). Rows are grouped by the values of ``group_key`` (default
``(step, problem_id)``); groups with fewer than 2 rollouts are skipped and counted. For every other
group: exact Fisher scores ``U_i`` (:func:`meshrl.diagnostics.fisher_scores`, full sequences with a
response mask, logits divided by ``temperature``), the coupling kernel ``K = U U^T`` and its cosine form,
``epsilon_partition(K~, eps)``, and ``strategy_masses`` by count and by normalised sequence probability
(sequence log-probs from ``collate`` / ``response_logits`` / ``token_logprobs``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl.analysis._common import (
    expand_param_names,
    finite_stats,
    load_for_analysis,
    pad_id_of,
    progress_bar,
    read_jsonl_rows,
    sequence_logprobs,
)

log = logging.getLogger("meshrl")

REQUIRED_FIELDS = ("prompt", "completion", "problem_id")
DEFAULT_GROUP_KEY = ("step", "problem_id")
_SCALARS = (str, int, float, bool, type(None))


@dataclass
class RolloutRow:
    """One valid input row."""

    line: int
    prompt: str
    completion: str
    key: tuple
    truncated: bool | None
    system: str | None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    model_mask: list[int] | None = None
    strategy_label: str | None = None


def _row_problem(rec: dict[str, Any], group_key: Sequence[str]) -> str | None:
    """Why ``rec`` cannot be used, or ``None``."""
    for name in REQUIRED_FIELDS:
        if name not in rec:
            return f"missing field {name!r}"
    for name in ("prompt", "completion"):
        if not isinstance(rec[name], str):
            return f"field {name!r} must be a string, got {type(rec[name]).__name__}"
    pid = rec["problem_id"]
    if isinstance(pid, bool) or not isinstance(pid, str | int):
        return f"field 'problem_id' must be a string or integer, got {type(pid).__name__}"
    for name in group_key:
        if not isinstance(rec.get(name), _SCALARS):
            return f"field {name!r} must be a JSON scalar, got {type(rec[name]).__name__}"
    if "truncated" in rec and not isinstance(rec["truncated"], bool):
        return f"field 'truncated' must be true or false, got {rec['truncated']!r:.40}"
    if rec.get("system") is not None and not isinstance(rec["system"], str):
        return f"field 'system' must be a string, got {type(rec['system']).__name__}"
    if rec.get("strategy_label") is not None and not isinstance(rec["strategy_label"], str):
        return f"field 'strategy_label' must be a string or null, got {type(rec['strategy_label']).__name__}"
    return _ids_problem(rec)


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def _ids_problem(rec: dict[str, Any]) -> str | None:
    """Why the exact-token fields of ``rec`` cannot be used, or ``None``."""
    has = [name for name in ("prompt_ids", "response_ids") if name in rec]
    if "model_mask" in rec and len(has) < 2:
        return "field 'model_mask' needs 'prompt_ids' and 'response_ids'"
    if not has:
        return None
    if len(has) == 1:
        return f"field {has[0]!r} needs its partner ('prompt_ids' and 'response_ids' go together)"
    for name in has:
        if not _is_id_list(rec[name]):
            return f"field {name!r} must be a list of token ids (integers >= 0)"
    if not rec["prompt_ids"]:
        return "field 'prompt_ids' is empty"
    mask = rec.get("model_mask")
    if mask is not None:
        if not isinstance(mask, list) or any(m not in (0, 1) or isinstance(m, bool) for m in mask):
            return "field 'model_mask' must be a list of 0/1"
        if len(mask) != len(rec["response_ids"]):
            return f"field 'model_mask' has {len(mask)} entries for {len(rec['response_ids'])} response ids"
    return None


def read_rollout_rows(
    rows: str | Path | Iterable[dict[str, Any]], group_key: Sequence[str] = DEFAULT_GROUP_KEY
) -> tuple[list[RolloutRow], list[dict[str, Any]], str]:
    """``(valid rows, skipped [{line, reason}], source)`` from a JSONL path or an iterable of dicts.

    A path that is missing, or a line that is not a JSON object, raises ``ValueError`` naming the file and
    line; rows with missing / mistyped fields are skipped and logged as ``SOURCE:LINE: skipped: REASON``.
    For an iterable, ``LINE`` is the 1-based position of the row.
    """
    if isinstance(group_key, str) or not group_key or not all(isinstance(g, str) and g for g in group_key):
        raise ValueError(f"group_key must be a non-empty sequence of field names, got {group_key!r}")
    if isinstance(rows, str | Path):
        source = str(rows)
        numbered = read_jsonl_rows(rows, "rollouts file")
    else:
        source = "rows"
        numbered = []
        for n, rec in enumerate(rows, 1):
            if not isinstance(rec, dict):
                raise ValueError(f"rows[{n - 1}] must be a dict, got {type(rec).__name__}")
            numbered.append((n, rec))
    valid, skipped = [], []
    for n, rec in numbered:
        why = _row_problem(rec, group_key)
        if why is not None:
            log.warning("%s:%d: skipped: %s", source, n, why)
            skipped.append({"line": n, "reason": why})
            continue
        key = tuple(rec.get(name) for name in group_key)
        valid.append(RolloutRow(n, rec["prompt"], rec["completion"], key, rec.get("truncated"), rec.get("system"),
                                rec.get("prompt_ids"), rec.get("response_ids"), rec.get("model_mask"),
                                rec.get("strategy_label")))
    return valid, skipped, source


def tokenize_rollout(tok: Any, row: RolloutRow, eos: int) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of one row: its exact ids when it has them, else re-tokenised as the module
    docstring says."""
    from meshrl.models import encode_prompt

    if row.prompt_ids is not None and row.response_ids is not None:
        return list(row.prompt_ids), list(row.response_ids)
    prompt = encode_prompt(tok, row.prompt, system=row.system)
    response = list(tok.encode(row.completion, add_special_tokens=False))
    if row.truncated is False:
        response.append(eos)
    return prompt, response


def full_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                   model_masks: list[list[int] | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, response_mask)`` ``[n, L]`` in the layout of
    :func:`meshrl.diagnostics.fisher_scores` (right padding keeps every row's positions ``0..len-1``
    without position ids). ``model_masks`` (episodes): the response mask keeps only each row's 1s."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    am = torch.zeros(len(prompts), width, dtype=torch.long)
    rm = torch.zeros(len(prompts), width)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        am[i, : len(p) + len(r)] = 1
        rm[i, len(p) : len(p) + len(r)] = 1
        mask = model_masks[i] if model_masks is not None else None
        if mask is not None:
            rm[i, len(p) : len(p) + len(r)] = torch.tensor(mask, dtype=rm.dtype)
    return ids, am, rm


def group_scores(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], pad_id: int, *,
                 temperature: float, params: list[str] | None, sketch_dim: int | None, seed: int,
                 model_masks: list[list[int] | None] | None = None) -> torch.Tensor:
    """``[G, P]`` exact Fisher scores of one group, or ``[G, k]`` count sketches.

    With ``sketch_dim`` the rollouts are scored one at a time and each exact row is sketched with the same
    seed (the hashes depend on ``(P, k, seed)`` only), so memory stays ``O(P + G k)``.
    """
    from meshrl.diagnostics import fisher_scores

    device = next(model.parameters()).device
    ids, am, rm = (t.to(device) for t in full_sequences(prompts, responses, pad_id, model_masks))
    if sketch_dim is None:
        return fisher_scores(model, ids, am, rm, temperature=temperature, params=params)
    rows = [fisher_scores(model, ids[i : i + 1], am[i : i + 1], rm[i : i + 1], temperature=temperature,
                          params=params, sketch_dim=sketch_dim, seed=seed) for i in range(ids.shape[0])]
    return torch.cat(rows)


def _group_record(key: dict[str, Any], lines: list[int], labels: torch.Tensor, masses: dict,
                  k_tilde: torch.Tensor) -> dict[str, Any]:
    g = k_tilde.shape[0]
    off = (k_tilde.sum() - torch.diagonal(k_tilde).sum()) / (g * (g - 1))
    return {
        "key": key,
        "lines": lines,
        "n_rollouts": g,
        "n_strategies": masses["n_strategies"],
        "labels": labels.tolist(),
        "count_mass": masses["count_mass"].tolist(),
        "prob_mass": masses["prob_mass"].tolist(),
        "max_count_mass": masses["max_count_mass"],
        "max_prob_mass": masses["max_prob_mass"],
        "mean_kernel_cos": float(off),
    }


def parser_label_figures(given: list[str | None], partition: list[int]) -> dict[str, Any]:
    """A group's parser labels beside its geometric partition (empty unless every rollout has a label).

    ``label_mass``: each label's share of the group; ``max_label_mass``: the largest; ``label_purity``: the share
    of rollouts whose epsilon-strategy's most common label is their own (1 = every geometric strategy holds one
    label; low = the partition mixes labels); ``label_split``: the share of labels spread over more than one
    epsilon-strategy (high = the geometry separates what the parser calls one strategy).
    """
    if not given or any(g is None for g in given):
        return {}
    mass = {lab: given.count(lab) / len(given) for lab in sorted(set(given))}  # type: ignore[arg-type]
    by_part: dict[int, list[str]] = {}
    for lab, part in zip(given, partition, strict=True):
        by_part.setdefault(part, []).append(lab)  # type: ignore[arg-type]
    agree = sum(max(v.count(x) for x in set(v)) for v in by_part.values())
    parts_of = {lab: {p for g2, p in zip(given, partition, strict=True) if g2 == lab} for lab in mass}
    return {"label_mass": mass, "max_label_mass": max(mass.values()), "label_purity": agree / len(given),
            "label_split": sum(len(v) > 1 for v in parts_of.values()) / len(parts_of)}


def _summary(groups: list[dict[str, Any]]) -> dict[str, Any]:
    ns = [g["n_strategies"] for g in groups]
    hist: dict[str, int] = {}
    for n in sorted(ns):
        hist[str(n)] = hist.get(str(n), 0) + 1
    return {
        "n_groups": len(groups),
        "n_rollouts": sum(g["n_rollouts"] for g in groups),
        "strategies_total": sum(ns),
        "strategies_mean": finite_stats(ns)[0],
        "strategies_min": min(ns) if ns else None,
        "strategies_max": max(ns) if ns else None,
        "max_count_mass_mean": finite_stats([g["max_count_mass"] for g in groups])[0],
        "max_prob_mass_mean": finite_stats([g["max_prob_mass"] for g in groups])[0],
        "n_strategies_hist": hist,
        **_label_summary(groups),
    }


def _label_summary(groups: list[dict[str, Any]]) -> dict[str, Any]:
    labelled = [g for g in groups if "label_mass" in g]
    if not labelled:
        return {}
    return {"labelled_groups": len(labelled),
            "max_label_mass_mean": finite_stats([g["max_label_mass"] for g in labelled])[0],
            "label_purity_mean": finite_stats([g["label_purity"] for g in labelled])[0]}


def _by_step(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    steps: dict[Any, list[dict[str, Any]]] = {}
    for g in groups:
        steps.setdefault(g["key"].get("step"), []).append(g)
    out = []
    for step, gs in steps.items():
        s = _summary(gs)
        out.append({"step": step, "n_groups": s["n_groups"], "strategies_mean": s["strategies_mean"],
                    "max_count_mass_mean": s["max_count_mass_mean"], "max_prob_mass_mean": s["max_prob_mass_mean"]})
    return out


def census(
    model_spec: str,
    rows: str | Path | Iterable[dict[str, Any]],
    *,
    eps: float = 0.05,
    params: Sequence[str] | str | None = None,
    sketch_dim: int | None = None,
    group_key: Sequence[str] = DEFAULT_GROUP_KEY,
    temperature: float = 1.0,
    seed: int = 0,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Count the epsilon-strategies of each group of logged rollouts under ``model_spec``.

    Args:
        model_spec: model spec, run directory or ``RUN_DIR/checkpoints/step_N`` (``load_policy``).
        rows: JSONL path or iterable of row dicts (fields: module docstring).
        eps: neighbourhood radius of :func:`meshrl.diagnostics.epsilon_partition`.
        params: parameter names or ``fnmatch`` globs (a list, or one comma-separated string) to
            differentiate; ``None`` = every parameter with ``requires_grad`` (for a LoRA run: its adapters).
        sketch_dim: count-sketch size ``k`` of the scores instead of the exact ``U`` (large models).
        group_key: fields whose values define a group (one query at one step by default).
        temperature: the sampling temperature of the rollouts (scores and log-probs use ``logits / T``).
        seed: model seed (tiny models) and sketch seed.
        device: ``auto`` | ``cpu`` | ``cuda``. progress: rich bar over groups (stderr).
    Returns:
        dict with ``model``, ``model_description``, ``source``, ``eps``, ``temperature``, ``params``
        (names or ``None``), ``n_params``, ``sketch_dim``, ``group_key``, ``rows_read``, ``rows_skipped``,
        ``skipped`` (``[{line, reason}]``), ``groups_skipped_small``, ``rollouts_in_small_groups``,
        ``groups`` (``[{key, lines, n_rollouts, n_strategies, labels, count_mass, prob_mass, max_count_mass,
        max_prob_mass, mean_kernel_cos}]``, masses indexed by strategy label), ``total`` (counts, means and
        a histogram of strategies per group) and, when ``step`` is in ``group_key``, ``by_step``.
    """
    from meshrl.diagnostics import coupling_kernel, epsilon_partition, strategy_masses
    from meshrl.rollout import eos_ids

    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if sketch_dim is not None and not (isinstance(sketch_dim, int) and sketch_dim >= 1):
        raise ValueError(f"sketch_dim must be None or an integer >= 1, got {sketch_dim!r}")
    valid, skipped, source = read_rollout_rows(rows, group_key)
    model, tok, desc = load_for_analysis(model_spec, seed=seed, device=device)
    names = expand_param_names(model, params)
    named = dict(model.named_parameters())
    n_params = sum(p.numel() for n, p in named.items() if (n in names if names is not None else p.requires_grad))
    eos = eos_ids(model, tok)
    pad = pad_id_of(tok, eos)

    grouped: dict[tuple, list[RolloutRow]] = {}
    for row in valid:
        grouped.setdefault(row.key, []).append(row)
    big = {k: v for k, v in grouped.items() if len(v) >= 2}
    small = [v for v in grouped.values() if len(v) < 2]
    groups: list[dict[str, Any]] = []
    with progress_bar("census", len(big), progress) as advance:
        for key, members in big.items():
            toks = [tokenize_rollout(tok, r, eos[0]) for r in members]
            prompts, responses = [p for p, _ in toks], [r for _, r in toks]
            for r, p in zip(members, prompts, strict=True):
                if not p:
                    raise ValueError(f"{source}:{r.line}: field 'prompt' encodes to no tokens")
            masks = [r.model_mask for r in members] if any(r.model_mask for r in members) else None
            U = group_scores(model, prompts, responses, pad, temperature=float(temperature), params=names,
                             sketch_dim=sketch_dim, seed=seed, model_masks=masks)
            _, k_tilde = coupling_kernel(U)
            labels = epsilon_partition(k_tilde, float(eps)).cpu()
            seq_logp, _ = sequence_logprobs(model, prompts, responses, pad, float(temperature), masks)
            masses = strategy_masses(labels, seq_logp)
            record = _group_record(dict(zip(group_key, key, strict=True)), [r.line for r in members], labels,
                                   masses, k_tilde.cpu())
            groups.append({**record, **parser_label_figures([r.strategy_label for r in members], labels.tolist())})
            advance()
    out: dict[str, Any] = {
        "model": str(model_spec),
        "model_description": desc,
        "source": source,
        "eps": float(eps),
        "temperature": float(temperature),
        "params": names,
        "n_params": n_params,
        "sketch_dim": sketch_dim,
        "group_key": list(group_key),
        "rows_read": len(valid) + len(skipped),
        "rows_skipped": len(skipped),
        "skipped": skipped,
        "groups_skipped_small": len(small),
        "rollouts_in_small_groups": sum(len(v) for v in small),
        "groups": groups,
        "total": _summary(groups),
    }
    if "step" in group_key:
        out["by_step"] = _by_step(groups)
    return out
