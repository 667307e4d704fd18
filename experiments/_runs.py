"""What the experiments share about a run the trainer ends early: such a run is a result (a divergence), recorded
with its step and reason and never resumed (a resume would reset the trainer's failure counters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def trainer_stops() -> tuple[type[BaseException], ...]:
    """The errors with which the trainer ends a run (imported when called: the experiments' CLIs start fast)."""
    from meshrl.trainer import HealthStop, NonFiniteAbort, RewardsFailed, StalledRun

    return NonFiniteAbort, StalledRun, HealthStop, RewardsFailed


def made_by() -> dict[str, Any]:
    """What a run's numbers depend on besides its seed and settings, for its ``done.json``: the CPU
    (:func:`meshrl.cpu.cpu_info`; float rounding follows it) and this call's code
    (:func:`meshrl.provenance.code_version`; each start's is in events.jsonl's ``run_start`` records)."""
    from meshrl.cpu import cpu_info
    from meshrl.provenance import code_version

    return {"machine": cpu_info(), "code": code_version()}


def last_step(run_dir: Path) -> int | None:
    """The last step in the run's metrics (None without any)."""
    from meshrl.jsonl import read_jsonl

    path = run_dir / "metrics.jsonl"
    return max((int(r["step"]) for r in read_jsonl(path) if "step" in r), default=None) if path.is_file() else None


def abort_reason(err: BaseException, run_dir: Path) -> str:
    """``"NonFiniteAbort at step 13: ..."``: what done.json records of a run the trainer ended."""
    return f"{type(err).__name__} at step {last_step(run_dir)}: {err}"


def stopped(err: KeyboardInterrupt) -> int:
    """A run stopped by a signal (SIGTERM, Ctrl-C): one line saying that a rerun resumes it, and the shell's exit
    status for that signal (128 + its number; 130 for a plain Ctrl-C)."""
    import sys

    signum = getattr(err, "signum", 2)
    print(f"stopped ({err or 'interrupted'}): finished runs and the others' last checkpoints are kept; the same "
          "command resumes them", file=sys.stderr)
    return 128 + signum
