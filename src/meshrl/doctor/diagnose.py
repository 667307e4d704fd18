"""``diagnose(path)``: run every check on a run's records and explain the result."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.doctor import checks_data as data
from meshrl.doctor import checks_tools as tools
from meshrl.doctor import checks_training as training
from meshrl.doctor.engines import load_run
from meshrl.doctor.findings import SEVERITIES, Finding, Unchecked
from meshrl.doctor.records import RunRecords
from meshrl.doctor.thresholds import DEFAULT, Thresholds

log = logging.getLogger("meshrl")

#: Every check, in report order: (the finding ids it can raise, the function).
CHECKS = [
    (("reward_collapse",), training.check_reward_collapse),
    (("parser_failure",), data.check_parser),
    (("reward_errors",), data.check_reward_errors),
    (("broken_grouping",), data.check_grouping),
    (("no_learning_signal",), data.check_signal),
    (("stall",), training.check_stall),
    (("update_blowup", "entropy_collapse", "entropy_explosion"), training.check_entropy),
    (("garbled_output",), data.check_garbled),
    (("truncation",), data.check_truncation),
    (("length_blowup", "length_collapse"), training.check_length),
    (("kl_blowup",), training.check_kl),
    (("ratio_tail",), training.check_ratio_tail),
    (("rollout_mismatch",), training.check_mismatch),
    (("stale_rollouts",), training.check_stale),
    (("grad_spike",), training.check_grad_spikes),
    (("nonfinite",), training.check_nonfinite),
    (("strategy_collapse",), data.check_strategy),
    (("lr_schedule",), training.check_lr),
    (("bf16_emulated",), training.check_bf16_emulated),
    (tools.TOOL_IDS, tools.check_tools),
    (("reward_without_accuracy",), tools.check_reward_without_accuracy),
]

#: A finding that explains others: when it is raised, these are its consequences and are folded into it
#: (listed under ``also``) instead of being reported as separate causes.
EXPLAINS = {
    "update_blowup": ("entropy_collapse", "entropy_explosion", "garbled_output", "no_learning_signal", "stall",
                      "reward_collapse"),
    "broken_grouping": ("no_learning_signal", "stall"),
    "parser_failure": ("no_learning_signal", "stall"),
    "no_learning_signal": ("stall",),
    "nonfinite": ("grad_spike",),
}


@dataclass
class Diagnosis:
    path: Path
    engine: str
    steps_logged: int
    findings: list[Finding]
    unchecked: list[Unchecked]
    passed: list[str]  # check ids that ran and found nothing
    notes: list[str] = field(default_factory=list)
    mapping: dict[str, str] = field(default_factory=dict)

    def alarming(self) -> list[Finding]:
        """Findings above ``info``."""
        return [f for f in self.findings if f.severity != "info"]

    def ids(self) -> list[str]:
        return [f.id for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite floats become the strings "nan" / "inf" (JSON has neither)."""
        return json_safe({"path": str(self.path), "engine": self.engine, "steps_logged": self.steps_logged,
                           "findings": [f.to_dict() for f in self.findings],
                           "unchecked": [u.to_dict() for u in self.unchecked], "passed": self.passed,
                           "notes": self.notes, "metric_mapping": self.mapping})


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def _fold(findings: list[Finding]) -> list[Finding]:
    by_id = {f.id: f for f in findings}
    dropped: set[str] = set()
    for cause, effects in EXPLAINS.items():
        if cause in by_id and cause not in dropped:
            for eff in effects:
                if eff in by_id and eff not in dropped:
                    dropped.add(eff)
                    by_id[cause].evidence.setdefault("also", []).append(f"{eff}: {by_id[eff].what}")
    return [f for f in findings if f.id not in dropped]


def diagnose_records(rec: RunRecords, thresholds: Thresholds = DEFAULT) -> Diagnosis:
    findings: list[Finding] = []
    unchecked: list[Unchecked] = []
    passed: list[str] = []
    for ids, check in CHECKS:
        try:
            result = check(rec, thresholds)
        except Exception as err:  # a broken check is said, never fatal: the live doctor runs inside training
            log.error("doctor: check %s failed on %s: %s: %s", check.__name__, rec.path, type(err).__name__, err)
            result = Unchecked(ids[0], f"the check failed ({type(err).__name__}: {err}); please report it")
        if isinstance(result, Unchecked):
            unchecked.append(result)
        elif result:
            findings += result
        else:
            passed += list(ids)
    findings = _fold(findings)
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))  # stable: report order within a severity
    return Diagnosis(path=rec.path, engine=rec.engine, steps_logged=len(rec.steps), findings=findings,
                     unchecked=unchecked, passed=passed, notes=rec.notes, mapping=rec.mapping)


def diagnose(path: str | Path, *, engine: str = "auto", thresholds: Thresholds = DEFAULT,
             samples: str | Path | None = None) -> Diagnosis:
    """Read the run at ``path`` (meshrl run directory, TRL output directory, verl log) and diagnose it; ``samples``:
    a verl run's generation dumps. ``ValueError`` (naming the path) when it is none of them."""
    return diagnose_records(load_run(path, engine, samples=samples), thresholds)
