"""Checkpoints: safetensors weights + optimizer + RNG state + step/cursor, a ``latest`` pointer, checked loads.

Layout::

    RUN_DIR/checkpoints/step_000010/{model.safetensors, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest          # text file holding "step_000010"

Writing (:func:`save_checkpoint`): every file goes into a hidden temporary sibling directory and is fsynced;
``state.json`` comes last and lists the size and SHA-256 of the other three. The directory is then renamed
into place (a re-save of an existing step swaps the two directories in one ``renameat2(RENAME_EXCHANGE)``),
``latest`` is replaced atomically, and only then are older checkpoints pruned. So at every instant ``latest``
names a complete checkpoint, whatever kills the process. A save that runs out of disk removes its partial
files and raises :class:`CheckpointSpaceError` naming the directory and the space it needs.

Reading (:func:`restore_checkpoint`): each candidate, ``latest`` first and then every ``step_*`` newest first,
is checked file by file (present, the recorded size and hash, loadable); the first intact one is loaded, with
a warning for each one passed over. A checkpoint written for another architecture is an error of its own.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from meshrl.jsonl import atomic_write_text, fsync_dir, umask_mode

log = logging.getLogger("meshrl")

STEP_DIR = re.compile(r"step_(\d+)")
TEMP_PREFIX = "."  # temporary directories and files are hidden siblings: ".step_000010.<random>"
DATA_FILES = ("model.safetensors", "optimizer.pt", "rng.pt")
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(ValueError):
    """A checkpoint cannot be written or none can be read (a ValueError: the CLI prints it on one line)."""


class CheckpointSpaceError(CheckpointError):
    """The disk filled up during a save; the partial checkpoint was removed."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint holds weights of another model architecture."""


# ---------------------------------------------------------------------- durable file operations
def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` atomically (Linux ``renameat2``); False where that is unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


# ---------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# ---------------------------------------------------------------------- directory listing
def step_dirs(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories under ``root``, oldest first (by step number). Only real
    directories: a ``step_N`` that is a symbolic link leads outside the run (:func:`remove_linked_steps`)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))


def remove_entry(path: Path) -> None:
    """Delete ``path``; a symbolic link is unlinked, never followed (what it names belongs to someone else)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_linked_steps(root: Path) -> list[str]:
    """Unlink ``step_N`` entries of ``root`` that are symbolic links (to another run's checkpoint, or dangling):
    a resume must not load them, nor a later save or prune write through them. What they point to is untouched."""
    if not root.is_dir():
        return []
    links = sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_symlink())
    for p in links:
        log.warning("%s is a symbolic link (to %s), not a checkpoint of this run: removed the link, not what it "
                    "names", p, os.readlink(p))
        p.unlink()
    return [p.name for p in links]


def step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def remove_temporaries(root: Path) -> list[str]:
    """Delete what interrupted saves left in ``root`` (hidden ``.step_*`` directories, ``.latest.*`` files)."""
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if p.name.startswith(TEMP_PREFIX):
            remove_entry(p)
            removed.append(p.name)
    if removed:
        log.warning("removed %d temporary file(s) left by an interrupted checkpoint save in %s: %s",
                    len(removed), root, ", ".join(sorted(removed)))
    return removed


def read_pointer(run_dir: Path) -> Path | None:
    """The directory ``checkpoints/latest`` names, or None without a pointer.

    The pointer must hold a bare ``step_N`` name: a path that leads elsewhere (``..``, ``/``) is refused,
    since a resume would otherwise load (and later prune) another run's files.
    """
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(f"checkpoint pointer {pointer} holds {name!r}, not a step_N directory of {root}; "
                              f"refusing to follow it outside the run directory")
    return root / name


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint to continue from: what ``latest`` names, else (with a warning) the newest ``step_*``
    with a ``state.json``; None when the run has none. Files are checked when loading, not here."""
    target = read_pointer(run_dir)
    if target is not None and not target.is_symlink() and (target / "state.json").is_file():
        return target
    candidates = [p for p in step_dirs(run_dir / "checkpoints") if (p / "state.json").is_file()]
    if target is not None:
        what = (f"a symbolic link (to {os.readlink(target)}), not followed" if target.is_symlink()
                else "missing or incomplete")
        log.warning("checkpoint pointer %s names %s, which is %s%s", run_dir / "checkpoints" / "latest",
                    target.name, what, f"; using {candidates[-1].name}" if candidates else "")
    return candidates[-1] if candidates else None


# ---------------------------------------------------------------------- writing
def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a checkpoint of ``model`` and ``optimizer`` takes on disk (tensor payloads; headers are small)."""
    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    weights = sum(nbytes(t) for t in model.state_dict().values())
    moments = sum(nbytes(v) for s in optimizer.state.values() for v in s.values())
    return weights + moments + (1 << 20)  # RNG state, JSON, pickle framing


def _is_space_error(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in SPACE_ERRNOS:
        return True
    text = str(err)  # safetensors (Rust) and torch's zip writer report the OS error in their message only
    return "No space left" in text or "os error 28" in text or "Disk quota exceeded" in text


def _space_error(root: Path, step: int, needed: int, err: BaseException | None) -> CheckpointSpaceError:
    free = shutil.disk_usage(root).free
    why = f" ({err})" if err is not None else ""
    earlier = [p.name for p in step_dirs(root) if step_of(p) < step]
    then = (f"the last checkpoint ({earlier[-1]}) is intact. Free some space and continue with --resume"
            if earlier else "this was the run's first checkpoint, so there is nothing to resume: free some space "
            "and start the run again")
    return CheckpointSpaceError(
        f"checkpoint step {step}: not enough disk space in {root}: it needs about {needed / 2**20:.1f} MiB, "
        f"{free / 2**20:.1f} MiB are free{why}; the partial files were removed and {then}")


def _write_files(tmp: Path, step: int, model, optimizer, state: dict[str, Any], rng: dict[str, Any]) -> None:
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng, tmp / "rng.pt")
    files = {}
    for name in DATA_FILES:
        _fsync_file(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    with (tmp / "state.json").open("w") as f:  # last: its presence means the others are complete
        f.write(json.dumps({"step": step, **state, "files": files}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def _move_into_place(tmp: Path, final: Path, root: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is swapped out atomically and then deleted."""
    if not final.exists():
        os.rename(tmp, final)
        return
    if not exchange_dirs(tmp, final):
        # No atomic swap here: point ``latest`` at an older intact checkpoint for the moment of the swap.
        older = [p for p in step_dirs(root) if p != final and (p / "state.json").is_file()]
        if older:
            atomic_write_text(root / "latest", older[-1].name)
        trash = root / f"{TEMP_PREFIX}{final.name}.old"
        os.rename(final, trash)
        os.rename(tmp, final)
        tmp = trash
    shutil.rmtree(tmp, ignore_errors=True)  # the replaced checkpoint


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    state: dict[str, Any], keep_last: int = 2, rng: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, move ``latest`` to it, then prune older ones.

    ``rng`` is the RNG state to record (default: the current one). Raises :class:`CheckpointSpaceError` when
    the disk is (or becomes) too full, after removing the partial files.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final = root / name
    needed = checkpoint_bytes(model, optimizer)
    if shutil.disk_usage(root).free < needed:
        raise _space_error(root, step, needed, None)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{TEMP_PREFIX}{name}."))
    try:
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp's 700 would stay on the step directory after the rename
        _write_files(tmp, step, model, optimizer, state, rng if rng is not None else rng_state())
        _move_into_place(tmp, final, root)
        fsync_dir(root)
        atomic_write_text(root / "latest", name)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        # torch's zip writer does not always say why a write failed: a disk now too full says it
        if isinstance(err, Exception) and (_is_space_error(err) or shutil.disk_usage(root).free < needed):
            raise _space_error(root, step, needed, err) from err
        raise
    _prune(root, keep_last, keep=name)
    return final


def _prune(root: Path, keep_last: int, keep: str) -> None:
    if keep_last <= 0:
        return
    for p in step_dirs(root)[:-keep_last]:
        if p.name != keep:
            remove_entry(p)


def remove_after(run_dir: Path, step: int) -> list[str]:
    """Delete checkpoints later than ``step`` (a resume from an earlier one abandons them with their records)."""
    gone = [p for p in step_dirs(run_dir / "checkpoints") if step_of(p) > step]
    for p in gone:
        remove_entry(p)
    return [p.name for p in gone]


# ---------------------------------------------------------------------- checking and reading
def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` (naming the file), or None when every file checks out."""
    if path.is_symlink():
        return f"{path} is a symbolic link (to {os.readlink(path)}), not a checkpoint of this run"
    state_file = path / "state.json"
    if state_file.is_symlink():
        return f"{state_file} is a symbolic link; a checkpoint's files must be its own"
    if not state_file.is_file():
        return f"{state_file} is missing"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{state_file} is not valid JSON ({e})"
    if not isinstance(state, dict):
        return f"{state_file} does not hold an object"
    problem = state_problem(state, path)
    if problem is not None:
        return f"{state_file}: {problem}"
    recorded = state.get("files") or {}
    for name in DATA_FILES:
        f = path / name
        if f.is_symlink():
            return f"{f} is a symbolic link (to {os.readlink(f)}); a checkpoint's files must be its own"
        if not f.is_file():
            return f"{f} is missing"
        want = recorded.get(name)
        if want is None:  # written before checkpoints recorded their files: the loaders check it
            continue
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{f} has {size} bytes, {want.get('bytes')} were written (truncated or replaced)"
        if _sha256(f) != want.get("sha256"):
            return f"{f} does not match the SHA-256 recorded when it was written (corrupt)"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def state_problem(state: dict[str, Any], path: Path) -> str | None:
    """What is wrong with the fields of checkpoint ``path``'s ``state.json`` (naming the field), or None.

    Nothing in it is trusted unchecked: a resume continues at its ``step`` and deletes the checkpoints after it,
    so ``step`` must be the directory's own number (a hand-edited 5 in ``step_000008`` would resume step-8 weights
    as step 5 and delete intact checkpoints as abandoned); counters are non-negative integers (``true`` is a bool
    in JSON, not 1); ``files`` maps each data file to its ``bytes`` and hex ``sha256``.
    """
    if not _is_count(state.get("step")):
        return f"field 'step' must be a non-negative integer, got {state.get('step')!r}"
    if STEP_DIR.fullmatch(path.name) and state["step"] != step_of(path):
        return f"field 'step' is {state['step']} but the directory is {path.name}"
    for key in ("cursor", "bad_in_row", "stalled_in_row"):
        if (key in state or key == "cursor") and not _is_count(state.get(key)):
            return f"field {key!r} must be a non-negative integer, got {state.get(key)!r}"
    files = state.get("files")
    if files is None:
        return None  # written before checkpoints recorded their files: the loaders check them
    if not isinstance(files, dict):
        return f"field 'files' must map file names to their size and hash, got {type(files).__name__}"
    for name, want in files.items():
        if not (isinstance(want, dict) and _is_count(want.get("bytes")) and isinstance(want.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", want["sha256"])):
            return f"field 'files.{name}' must be {{bytes: integer, sha256: 64 hex digits}}, got {want!r}"
    return None


def check_architecture(path: Path, model: torch.nn.Module) -> None:
    """Raise :class:`CheckpointMismatch` unless the checkpoint's tensors have the model's names and shapes."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    sd = model.state_dict()
    ours = {k: tuple(v.shape) for k, v in sd.items()}
    unexpected = sorted(set(shapes) - set(ours))
    # Tied tensors (embeddings and head) are stored once, under one of their names.
    stored_ptrs = {sd[k].data_ptr() for k in shapes if k in sd}
    missing = sorted(k for k in set(ours) - set(shapes) if sd[k].data_ptr() not in stored_ptrs)
    resized = [f"{k}: {shapes[k]} in the checkpoint, {ours[k]} in the model"
               for k in sorted(set(shapes) & set(ours)) if shapes[k] != ours[k]]
    if unexpected or missing or resized:
        parts = []
        if resized:
            parts.append(f"{len(resized)} tensor(s) of another shape (e.g. {resized[0]})")
        if missing:
            parts.append(f"{len(missing)} tensor(s) of the model absent (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown tensor(s) (e.g. {unexpected[0]})")
        raise CheckpointMismatch(f"checkpoint {path} was written for another model architecture: "
                                 f"{'; '.join(parts)}. Resume with the model the run was started with")


def load_named_checkpoint(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """The weights of the checkpoint the user named (``RUN_DIR/checkpoints/step_N``), its files checked first:
    a damaged one is refused in one line naming the file (never a fallback to another step they did not ask
    for, never a loader's traceback)."""
    problem = checkpoint_problem(path)
    if problem is None:
        try:
            return load_checkpoint(path, model, restore_rng=False)
        except CheckpointMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - a file that checked out but does not load is corrupt too
            problem = f"{path} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    raise CheckpointError(f"checkpoint {path} is damaged: {problem}; name another step_N, or the run directory "
                          f"to use its newest intact checkpoint")


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True
) -> dict[str, Any]:
    """Restore weights (and optimizer, RNG) from ``path``; return its ``state.json`` dict."""
    check_architecture(path, model)
    state = json.loads((path / "state.json").read_text())
    optim_state = torch.load(path / "optimizer.pt", weights_only=False) if optimizer is not None else None
    rng = torch.load(path / "rng.pt", weights_only=False) if restore_rng else None
    load_model(model, str(path / "model.safetensors"), strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)
    if rng is not None:
        set_rng_state(rng)
    return state


def restore_checkpoint(
    run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
    restore_rng: bool = True,
) -> tuple[Path, dict[str, Any]]:
    """Load the newest intact checkpoint of ``run_dir``: ``latest`` first, then ``step_*`` newest first.

    Each one passed over gets a warning naming its faulty file; with none intact the error lists them all.
    """
    root = run_dir / "checkpoints"
    pointed = read_pointer(run_dir)
    candidates = ([pointed] if pointed is not None else []) + [p for p in reversed(step_dirs(root)) if p != pointed]
    if not candidates:
        raise CheckpointError(f"no checkpoint to resume from in {root}")
    problems = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            try:
                state = load_checkpoint(path, model, optimizer, restore_rng=restore_rng)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - a file that checked out but does not load is corrupt too
                problem = f"{path} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            else:
                if problems:
                    log.warning("using %s, the newest intact checkpoint (passed over: %s)", path.name,
                                "; ".join(problems))
                return path, state
        log.warning("checkpoint %s is unusable: %s", path.name, problem)
        problems.append(problem)
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(problems))
