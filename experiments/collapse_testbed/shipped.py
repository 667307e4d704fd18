"""The experiments' warm starts, shipped in the repository with their SHA-256: fixed weights for every rerun.

A warm start built from settings alone is not fixed: the same settings (one cache key) gave different weights on
different machines, because float rounding follows the CPU's vector instructions and the thread count
(results.md, "120 steps", "Which warm start"). So an experiment that must be rerun from the same weights names
one of :data:`WARM_STARTS` (``--warm W2``), and the runner loads ``warm_starts/NAME/`` only after every file's
SHA-256 matches ``warm_starts/MANIFEST.json`` (:func:`shipped_warm_start`).

- ``W1``: the first experiment's settings (``round1``: no coach variants, warm seed 0). Byte-identical to the
  copy shipped with the package for ``meshrl demo`` (``meshrl.testbed.warm.SHIPPED``), kept here as well so
  that a rebuild of the demo's copy never changes this experiment's weights.
- ``W2``: the second experiment's settings (``round2``: the coach variants, warm seed 0), built on the machine
  named in the manifest; the second experiment's own and the reading list's builds (same settings) differ.
- ``W3``: ``W2``'s settings with warm seed 1, a third independent warm start (the reading list's original cannot
  be rebuilt: it shares ``W2``'s settings key and came out different only through another machine's rounding).

``python -m experiments.collapse_testbed --build-warm-starts [NAMES]`` builds the missing ones (one thread each,
about 6 minutes per warm start on one core) and records them in the manifest; ``--force`` rebuilds existing ones.
A one-thread build is repeatable on one machine (``W2`` built twice gave the same ``model.safetensors``); on
another CPU it need not be, which is why the weights are shipped.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WARM_DIR = HERE / "warm_starts"
MANIFEST = WARM_DIR / "MANIFEST.json"
#: a one-thread build: the order of the reductions then does not depend on the machine's core count (the CPU's
#: vector instructions still change the last bits, which is why the weights are shipped rather than rebuilt)
BUILD_THREADS = 1


@dataclass(frozen=True)
class WarmDef:
    """A shipped warm start: the ``ExperimentSettings`` warm fields it is built from, and why it exists."""

    warm_seed: int
    warm_steps: int
    warm_coach_variants: bool
    task: str
    about: str

    def experiment_fields(self) -> dict[str, Any]:
        """The ``ExperimentSettings`` fields a run from this warm start records (settings.json)."""
        return {"warm_seed": self.warm_seed, "warm_steps": self.warm_steps,
                "warm_coach_variants": self.warm_coach_variants, "task": self.task}

    def settings(self) -> dict[str, Any]:
        """The full warm-start settings (``meshrl.testbed.warm.warm_settings``), as the runner would build them."""
        from meshrl.testbed.warm import warm_settings

        return warm_settings(seed=self.warm_seed, steps=self.warm_steps, preset="tiny:small", batch_size=64,
                             lr=3e-3, coach_fraction=0.06, task=self.task,
                             coach_variants=self.warm_coach_variants)


WARM_STARTS: dict[str, WarmDef] = {
    "W1": WarmDef(0, 700, False, "testbed:add", "round one's settings (preset round1): no coach variants, warm "
                  "seed 0; the same bytes as the package's shipped warm start (meshrl demo)"),
    "W2": WarmDef(0, 700, True, "testbed:add", "round two's settings (preset round2): coach variants, warm seed 0; "
                  "rebuilt here (the originals of round two and the reading list differ from it and each other)"),
    "W3": WarmDef(1, 700, True, "testbed:add", "round two's settings with warm seed 1: a third warm start in place "
                  "of the reading list's, which shares W2's settings key and cannot be rebuilt"),
}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_name(name: str) -> WarmDef:
    if name not in WARM_STARTS:
        raise ValueError(f"unknown warm start {name!r}; shipped: {', '.join(WARM_STARTS)}")
    return WARM_STARTS[name]


def verify(name: str, root: Path | None = None, manifest: dict[str, Any] | None = None) -> Path:
    """``root/name`` after checking that it holds exactly the manifest's files with their SHA-256; a missing,
    extra or changed file is a ``ValueError`` naming it (one line)."""
    _check_name(name)
    root = WARM_DIR if root is None else root
    entry = (read_manifest(root / MANIFEST.name) if manifest is None else manifest).get(name)
    if entry is None:
        raise ValueError(f"warm start {name}: not in {root / MANIFEST.name}; build it with --build-warm-starts {name}")
    d = root / name
    present = {p.name for p in d.iterdir() if p.is_file()} if d.is_dir() else set()
    extra = sorted(present - set(entry["files"]))
    if extra:
        raise ValueError(f"warm start {name}: {d / extra[0]} is not in the manifest; remove it")
    for fname, digest in sorted(entry["files"].items()):
        path = d / fname
        if not path.is_file():
            raise ValueError(f"warm start {name}: {path} is missing")
        if sha256_file(path) != digest:
            raise ValueError(f"warm start {name}: {path} does not match its SHA-256 in the manifest "
                             f"(expected {digest[:16]}...); restore it from git")
    return d


def shipped_warm_start(name: str, task: str) -> Path:
    """The verified directory of shipped warm start ``name`` for an experiment on ``task``."""
    wd = _check_name(name)
    if task != wd.task:
        raise ValueError(f"warm start {name} is for {wd.task}, not {task}")
    return verify(name)


def apply_warm(name: str, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` (ExperimentSettings fields) with the warm fields of ``name`` on top, so that settings.json
    records what the weights were built from; a conflicting explicit task is refused."""
    wd = _check_name(name)
    if changes.get("task") not in (None, wd.task):
        raise ValueError(f"--warm {name} is a {wd.task} warm start; it cannot run --task {changes['task']}")
    return {**changes, **wd.experiment_fields(), "warm": name}


def manifest_entry(name: str, d: Path) -> dict[str, Any]:
    """The manifest record of a built warm start: its settings, how it was built, each file's size and SHA-256."""
    from meshrl.testbed.warm import MARKER

    info = json.loads((d / MARKER).read_text())
    files = sorted(p for p in d.iterdir() if p.is_file())
    return {"about": WARM_STARTS[name].about, "experiment_settings": WARM_STARTS[name].experiment_fields(),
            "settings": info["settings"],
            "built": {k: info.get(k) for k in ("seconds", "threads", "params", "final_loss")},
            "bytes": sum(p.stat().st_size for p in files), "files": {p.name: sha256_file(p) for p in files}}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else ``platform.machine()``: what a build's last bits
    depend on, recorded beside the weights."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def build_warm_starts(names: list[str], *, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Build the named warm starts into ``warm_starts/NAME`` (an existing complete one is kept unless ``force``)
    and write their manifest entries (the other entries are kept); returns the manifest."""
    from meshrl.testbed.warm import MARKER, warm_start

    manifest = read_manifest(WARM_DIR / MANIFEST.name)
    for name in names:
        wd = _check_name(name)
        d = WARM_DIR / name
        if force or name not in manifest:
            # a complete directory without a manifest entry (copied in, or built by warm_start directly) is
            # recorded as it is, not rebuilt: its machine is then unknown to this call
            built_here = force or not (d / MARKER).is_file()
            warm_start(d, seed=wd.warm_seed, steps=wd.warm_steps, task=wd.task,
                       coach_variants=wd.warm_coach_variants, threads=BUILD_THREADS, progress=progress, force=force)
            entry = manifest_entry(name, d)
            if entry["settings"] != wd.settings():
                raise ValueError(f"{d}: built with other settings than {name}'s")
            manifest[name] = {**entry, "machine": cpu_name() if built_here else None}
        else:
            verify(name, manifest=manifest)
        WARM_DIR.mkdir(parents=True, exist_ok=True)
        (WARM_DIR / MANIFEST.name).write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return manifest
