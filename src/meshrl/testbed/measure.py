"""Ground-truth measurements on the testbed: strategy shares and forced-strategy accuracy per problem type.

``strategy_shares`` samples the policy as it is (no prefix) and labels every rollout with the parser;
``forced_accuracy`` starts every response with a strategy tag and measures how often that procedure
reaches the right answer within the budget, per problem type. The second is how the niches are shown:
a table whose rows are types and whose best column differs from row to row.

Both sample with ``meshrl.rollout.make_backend("hf", model, tokenizer)``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.tasks import Problem
from meshrl.testbed.traces import STRATEGIES

OTHER = "other"


@dataclass
class ShareReport:
    """Unprompted rollouts, labelled.

    ``shares``: fraction of rollouts per procedure (``c``, ``t``, ``r``; a trace cut off by the budget
    counts as the procedure it was writing) and ``other`` (no tag or malformed). ``accuracy`` is the
    strict reward's mean; ``*_by_type`` break both down by ``meta["type"]``. ``over_budget``: fraction of
    rollouts longer than the budget (they score 0).
    """

    n_problems: int
    n: int
    temperature: float
    shares: dict[str, float]
    accuracy: float
    accuracy_by_type: dict[str, float]
    shares_by_type: dict[str, dict[str, float]]
    accuracy_by_strategy: dict[str, float]
    over_budget: float
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def max_share(self) -> float:
        """Largest share among the three procedures (``other`` excluded)."""
        return max(self.shares.get(s, 0.0) for s in STRATEGIES)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"max_share": self.max_share}

    def table(self) -> str:
        """Markdown: shares and accuracy, overall and per type."""
        cols = [*STRATEGIES, OTHER]
        lines = ["| type | " + " | ".join(f"share {c}" for c in cols) + " | accuracy |",
                 "|---" * (len(cols) + 2) + "|"]
        for kind, shares in [*self.shares_by_type.items(), ("all", self.shares)]:
            acc = self.accuracy if kind == "all" else self.accuracy_by_type[kind]
            lines.append(f"| {kind} | " + " | ".join(f"{shares.get(c, 0.0):.2f}" for c in cols) + f" | {acc:.3f} |")
        return "\n".join(lines)


@dataclass
class ForcedReport:
    """Accuracy with the procedure forced (response starts with its tag), per (strategy, type).

    ``accuracy[s][k]``: share of forced rollouts that are right *and* whose working is procedure ``s``
    (``label_strategy(..., loose=True) == s``). At the warm start the tag decides the procedure, but RL
    can decouple them (a model after GRPO wrote tens-then-ones working after an ``r:`` tag on ``decade``
    problems), so the tag alone no longer forces anything. ``raw_accuracy`` counts every right answer;
    ``followed[s][k]`` is the share whose working is ``s``; ``well_formed[s]`` the share of complete,
    strictly well-formed ``s`` traces over all types.
    """

    n_problems: int
    n: int
    temperature: float
    accuracy: dict[str, dict[str, float]]  # strategy -> type -> accuracy (right and procedure followed)
    overall: dict[str, float]  # strategy -> accuracy over all problems
    raw_accuracy: dict[str, dict[str, float]]  # strategy -> type -> accuracy (right, any working)
    followed: dict[str, dict[str, float]]  # strategy -> type -> share of rollouts doing procedure s
    well_formed: dict[str, float]

    def winners(self) -> dict[str, str]:
        """The procedure with the highest forced accuracy on each type."""
        kinds = next(iter(self.accuracy.values())).keys()
        return {k: max(self.accuracy, key=lambda s: self.accuracy[s][k]) for k in kinds}

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"winners": self.winners()}

    def table(self) -> str:
        """Markdown: rows are problem types, columns the forced procedures; the winner in bold."""
        kinds = list(next(iter(self.accuracy.values())).keys())
        win = self.winners()
        lines = ["| type | " + " | ".join(f"forced {s}" for s in self.accuracy) + " |",
                 "|---" * (len(self.accuracy) + 1) + "|"]
        for k in kinds:
            cells = [f"**{self.accuracy[s][k]:.3f}**" if win[k] == s else f"{self.accuracy[s][k]:.3f}"
                     for s in self.accuracy]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("| all | " + " | ".join(f"{self.overall[s]:.3f}" for s in self.accuracy) + " |")
        return "\n".join(lines)


def _sample(model, tok, prompts: list[list[int]], n: int, temperature: float, seed: int,
            max_new_tokens: int, batch_size: int | None) -> list[str]:
    from meshrl.rollout import SamplingParams, make_backend

    backend = make_backend("hf", model, tok, batch_size=batch_size)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n)
    return backend.generate(prompts, params, seed=seed).texts


def _type(problem: Problem) -> str:
    return str(problem.meta.get("type", "?"))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def strategy_shares(model, tok, task, problems: Sequence[Problem], n: int = 8, temperature: float = 1.0,
                    seed: int = 0, *, max_new_tokens: int | None = None, loose: bool = True,
                    batch_size: int | None = 512) -> ShareReport:
    """Sample ``n`` unprompted responses per problem and report procedure shares and accuracy.

    Labels are ``label_strategy(text, partial=True, loose=loose)``: a trace cut off by the budget counts
    as the procedure it was writing, and (``loose``) a procedure whose tag RL wore off still counts.
    ``max_new_tokens`` defaults to ``task.max_new_tokens`` (budget + 1); ``batch_size`` bounds the
    sequences per ``generate`` call.
    """
    from meshrl.models import encode_prompt

    problems = list(problems)
    if not problems or n < 1:
        raise ValueError("strategy_shares needs at least one problem and n >= 1")
    max_new = max_new_tokens or task.max_new_tokens
    prompts = [encode_prompt(tok, task.format_prompt(p)) for p in problems]
    texts = _sample(model, tok, prompts, n, temperature, seed, max_new, batch_size)
    labels, scores, kinds, over = [], [], [], 0
    for i, text in enumerate(texts):
        problem = problems[i // n]
        labels.append(task.label_strategy(text, partial=True, loose=loose) or OTHER)
        scores.append(task.score(text, problem))
        kinds.append(_type(problem))
        over += len(text) > task.budget
    by_type_scores, by_type_labels, by_label = defaultdict(list), defaultdict(list), defaultdict(list)
    for label, score, kind in zip(labels, scores, kinds, strict=True):
        by_type_scores[kind].append(score)
        by_type_labels[kind].append(label)
        by_label[label].append(score)
    cols = [*STRATEGIES, OTHER]

    def shares(ls: list[str]) -> dict[str, float]:
        c = Counter(ls)
        return {k: c[k] / len(ls) for k in cols}

    order = [k for k in getattr(task, "types", ()) if k in by_type_scores] or sorted(by_type_scores)
    return ShareReport(
        n_problems=len(problems), n=n, temperature=temperature, shares=shares(labels), accuracy=_mean(scores),
        accuracy_by_type={k: _mean(by_type_scores[k]) for k in order},
        shares_by_type={k: shares(by_type_labels[k]) for k in order},
        accuracy_by_strategy={k: _mean(by_label[k]) for k in cols if by_label[k]},
        over_budget=over / len(texts), counts=dict(Counter(labels)),
    )


def forced_accuracy(model, tok, task, problems: Sequence[Problem], n: int = 4, temperature: float = 1.0,
                    seed: int = 0, *, strategies: Sequence[str] = STRATEGIES, max_new_tokens: int | None = None,
                    batch_size: int | None = 512) -> ForcedReport:
    """Accuracy per (strategy, problem type) with each response forced to start with the strategy's tag.

    The tag counts toward the budget (the response is ``tag + generated text``), so a forced response has
    ``budget - len(tag) + 1`` new tokens at most by default.
    """
    problems = list(problems)
    if not problems or n < 1:
        raise ValueError("forced_accuracy needs at least one problem and n >= 1")
    order = [k for k in getattr(task, "types", ()) if any(_type(p) == k for p in problems)]
    order = order or sorted({_type(p) for p in problems})
    acc: dict[str, dict[str, float]] = {}
    raw: dict[str, dict[str, float]] = {}
    followed: dict[str, dict[str, float]] = {}
    overall: dict[str, float] = {}
    formed: dict[str, float] = {}
    for j, strategy in enumerate(strategies):
        forced = [task.forced_prompt(p, strategy) for p in problems]
        tag = forced[0].assistant_prefix
        max_new = max_new_tokens or (task.max_new_tokens - len(tag))
        texts = _sample(model, tok, [f.ids(tok) for f in forced], n, temperature, seed + 7919 * j, max_new,
                        batch_size)
        per_type: dict[str, list[tuple[float, bool]]] = defaultdict(list)
        ok = 0
        for i, text in enumerate(texts):
            problem, completion = problems[i // n], tag + text
            own = task.label_strategy(completion, partial=True, loose=True) == strategy
            per_type[_type(problem)].append((task.score(completion, problem), own))
            ok += task.label_strategy(completion, partial=False, loose=False) == strategy
        acc[strategy] = {k: _mean([sc * own for sc, own in per_type[k]]) for k in order}
        raw[strategy] = {k: _mean([sc for sc, _ in per_type[k]]) for k in order}
        followed[strategy] = {k: _mean([float(own) for _, own in per_type[k]]) for k in order}
        overall[strategy] = _mean([sc * own for k in order for sc, own in per_type[k]])
        formed[strategy] = ok / len(texts)
    return ForcedReport(n_problems=len(problems), n=n, temperature=temperature, accuracy=acc, overall=overall,
                        raw_accuracy=raw, followed=followed, well_formed=formed)


@dataclass
class CoachReport:
    """Rollouts conditioned on each rule-coach prefix (system placement, as the ``mesh`` recipes do).

    ``follow[s][k]`` is the share of rollouts labelled ``k`` when the prefix describes ``s``;
    ``accuracy[s]`` their mean reward. A model that follows the coach has ``follow[s][s]`` near 1.
    """

    n_problems: int
    n: int
    placement: str
    template: str
    follow: dict[str, dict[str, float]]
    accuracy: dict[str, float]

    def follow_rate(self) -> float:
        """Mean over prefixes of the share of rollouts that use the described procedure."""
        return _mean([self.follow[s][s] for s in self.follow])

    def table(self) -> str:
        cols = [*STRATEGIES, OTHER]
        lines = ["| coach prefix | " + " | ".join(f"share {c}" for c in cols) + " | accuracy |",
                 "|---" * (len(cols) + 2) + "|"]
        for s, row in self.follow.items():
            lines.append(f"| {s} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + f" | {self.accuracy[s]:.3f} |")
        return "\n".join(lines)


def coached_shares(model, tok, task, problems: Sequence[Problem], n: int = 4, temperature: float = 1.0,
                   seed: int = 0, *, placement: str = "system", template: str = "wrapped",
                   batch_size: int | None = 64) -> CoachReport:
    """Sample with each of the task's rule-coach prefixes, as a Coach Prompting run would.

    ``template="wrapped"``: the prefix wrapped by ``meshrl.mesh.wrap_prefix(prefix, placement)``, which is
    what the ``cp_only``/``mesh`` recipes feed the model today (long prompts: keep ``problems`` small);
    ``template="plain"``: the prefix text alone, as the system prompt (``placement="system"``) or at the
    start of the answer. Use it to check that a warm start reacts to coach prefixes at all.
    """
    from meshrl.models import encode_prompt
    from meshrl.testbed.warm import coach_system_prompt

    problems = list(problems)
    if not problems or n < 1:
        raise ValueError("coached_shares needs at least one problem and n >= 1")
    prefixes = task.coach_strategies(problems[0])
    follow: dict[str, dict[str, float]] = {}
    accuracy: dict[str, float] = {}
    for j, (strategy, prefix) in enumerate(zip(task.strategies, prefixes, strict=True)):
        if template == "wrapped":
            from meshrl.mesh import wrap_prefix

            wrapped = wrap_prefix(prefix, placement)
        else:
            wrapped = coach_system_prompt(prefix, template)
        if placement == "system":
            prompts = [encode_prompt(tok, task.format_prompt(p), system=wrapped) for p in problems]
        else:
            prompts = [encode_prompt(tok, task.format_prompt(p), assistant_prefix=wrapped) for p in problems]
        texts = _sample(model, tok, prompts, n, temperature, seed + 104729 * j, task.max_new_tokens, batch_size)
        labels = Counter(task.label_strategy(t, partial=True, loose=True) or OTHER for t in texts)
        follow[strategy] = {k: labels[k] / len(texts) for k in [*STRATEGIES, OTHER]}
        accuracy[strategy] = _mean([task.score(t, problems[i // n]) for i, t in enumerate(texts)])
    return CoachReport(n_problems=len(problems), n=n, placement=placement, template=template, follow=follow,
                       accuracy=accuracy)


def eval_shares(eval_dir: Path, task) -> dict[str, Any]:
    """Unconditioned strategy shares of the samples of the evaluation in ``eval_dir`` (``eval_samples.jsonl``,
    labelled by ``task.label_strategy``), overall and per type, and the mean over problems of the per-problem
    max share."""
    from meshrl.jsonl import read_jsonl

    path = eval_dir / "eval_samples.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    names = tuple(task.strategies)
    overall: Counter = Counter()
    by_type: dict[str, Counter] = defaultdict(Counter)
    per_problem: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        lab = task.label_strategy(r["completion"]) or OTHER
        overall[lab] += 1
        by_type[r.get("group", "?")][lab] += 1
        per_problem[r["problem_id"]][lab] += 1

    def shares(c: Counter) -> dict[str, float]:
        n = sum(c.values())
        return {s: c[s] / n for s in (*names, OTHER)} if n else {}

    pmax = [max(c.values()) / sum(c.values()) for c in per_problem.values()]
    return {"overall": shares(overall), "by_type": {t: shares(c) for t, c in sorted(by_type.items())},
            "problem_max_mass": sum(pmax) / len(pmax) if pmax else math.nan}
