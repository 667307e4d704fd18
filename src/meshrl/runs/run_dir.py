"""The run directory before a run starts or resumes: what is refused, cleaned and rewritten.

A fresh run refuses a directory that already holds checkpoints (that is a ``--resume``) and starts clean,
saying so, in one whose earlier run stopped before its first checkpoint (its records could not be continued:
re-running the same command would otherwise append steps 1, 2, 3 after 1, 2, 3). Both fresh runs and
resumes first delete the temporaries that interrupted saves leave. A resume drops the records written after
its checkpoint (and a partial last line) and the checkpoints of the abandoned steps after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from meshrl.jsonl import TEMP_PREFIX, truncate_after_step
from meshrl.runs.checkpoint import (
    atomic_write_text,
    latest_checkpoint,
    remove_after,
    remove_entry,
    remove_linked_steps,
    remove_temporaries,
    step_dirs,
)

log = logging.getLogger("meshrl")

RECORDS = ("metrics.jsonl", "samples.jsonl", "events.jsonl", "evals.jsonl")
DERIVED = ("summary.json",)


def check_out_dir(out: str | Path, option: str = "--out") -> Path:
    """``out`` as a Path if a directory can be written there: ``ValueError`` naming ``option`` when ``out`` is an
    existing file, or when one of its parents is a file (mkdir would fail with a traceback deep inside)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {out} is a file, not a directory; choose another {option}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option} {out}: {parent} is a file, not a directory; choose another {option}")
            break
    return out


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir``; a clear error when it (or a parent) is a file."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file, not a directory; choose another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(f"run directory {run_dir} cannot be created: a part of its path is a file ({e})") from e


def _remove_record_temporaries(run_dir: Path) -> None:
    """Temporary siblings of the records and the config (``.metrics.jsonl.XXXX``) left by a kill mid-rewrite."""
    for name in (*RECORDS, *DERIVED, "config.yaml"):
        for tmp in run_dir.glob(f".{name}.*"):
            tmp.unlink(missing_ok=True)


MARKER = ".meshrl-run"  # written first into every run directory: what meshrl may clean, rewrite and delete


def _marker_temporaries(run_dir: Path) -> list[Path]:
    """The temporary siblings of the marker: a kill while the marker was being written leaves one in a directory
    that held nothing else, and that directory is ours to use (it must not be refused as the user's)."""
    return sorted(p for p in run_dir.glob(f"{TEMP_PREFIX}{MARKER}.*") if p.is_file() and not p.is_symlink())


def is_ours(run_dir: Path, legacy: bool = True) -> bool:
    """Whether meshrl may clean, rewrite and delete in ``run_dir``: it is missing, empty (but for a marker
    temporary), marked, or (``legacy``) a run of a meshrl from before the marker (it holds ``checkpoints/`` or
    ``metrics.jsonl``). A caller that deletes the whole directory passes ``legacy=False``: that guess was made for
    runs, which rewrite only their own records."""
    if not run_dir.is_dir() or (run_dir / MARKER).is_file():
        return True
    leftovers = set(_marker_temporaries(run_dir))
    if not any(p not in leftovers for p in run_dir.iterdir()):
        return True
    return legacy and ((run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file())


def check_is_ours(run_dir: Path, option: str = "--out") -> None:
    """Refuse a non-empty ``run_dir`` that meshrl did not create (see ``is_ours``): the run would overwrite the
    user's ``config.yaml`` and delete files named like its records."""
    if is_ours(run_dir):
        return
    entries = sorted(p.name for p in run_dir.iterdir())
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise ValueError(f"{option} {run_dir} is a non-empty directory that is not a meshrl run ({shown}); meshrl "
                     f"would overwrite or delete files there: choose a new or empty directory")


def mark_run_dir(run_dir: Path) -> None:
    if not (run_dir / MARKER).is_file():
        atomic_write_text(run_dir / MARKER, "written by meshrl: this directory holds a training run\n")
    for tmp in _marker_temporaries(run_dir):
        tmp.unlink(missing_ok=True)


def prepare_fresh(run_dir: Path) -> None:
    """Make ``run_dir`` ready for a run from step 0 (see the module docstring)."""
    check_is_ours(run_dir)
    make_run_dir(run_dir)
    mark_run_dir(run_dir)
    root = run_dir / "checkpoints"
    remove_temporaries(root)
    remove_linked_steps(root)
    _remove_record_temporaries(run_dir)
    last = latest_checkpoint(run_dir)  # refuses a pointer that leads outside the run directory
    if last is not None:
        raise ValueError(f"{run_dir} already holds a run (checkpoint {last.name}); continue it with --resume "
                         f"{run_dir}, or choose another --out")
    stale = [name for name in (*RECORDS, *DERIVED) if (run_dir / name).exists()]
    stale += [f"checkpoints/{p.name}" for p in step_dirs(root)]  # none complete (no state.json)
    stale += ["checkpoints/latest"] if (root / "latest").exists() else []
    if stale:
        log.warning("%s holds the records of a run that stopped before its first checkpoint (%s): there is "
                    "nothing to resume, so the run starts again from step 0 and replaces them", run_dir,
                    ", ".join(stale))
        for name in stale:
            remove_entry(run_dir / name)


def prepare_resume(run_dir: Path) -> None:
    """Before the checkpoint is read: delete temporaries of interrupted saves and rewrites."""
    if not run_dir.is_dir():
        raise ValueError(f"--resume {run_dir}: no such run directory")
    check_is_ours(run_dir, "--resume")
    mark_run_dir(run_dir)
    remove_temporaries(run_dir / "checkpoints")
    remove_linked_steps(run_dir / "checkpoints")
    _remove_record_temporaries(run_dir)


def rewind_records(run_dir: Path, step: int) -> None:
    """After resuming from checkpoint ``step``: drop later records and the abandoned later checkpoints."""
    for name in RECORDS:
        truncate_after_step(run_dir / name, step)
    gone = remove_after(run_dir, step)
    if gone:
        log.warning("resuming from step %d: removed the later checkpoint(s) %s of the abandoned steps",
                    step, ", ".join(gone))
    pointer, name = run_dir / "checkpoints" / "latest", f"step_{step:06d}"
    if not pointer.is_file() or pointer.read_text().strip() != name:  # it named a damaged one: never a missing one
        atomic_write_text(pointer, name)


def write_config(config: dict, run_dir: Path) -> None:
    """``config.yaml``, atomically (a kill mid-write must not leave a run that cannot be resumed)."""
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
