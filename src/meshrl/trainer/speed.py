"""Speed paths: everything that makes the update's forward or the step's memory cheaper, behind one seam.

The trainer's step (:mod:`meshrl.trainer.step`) and the update's forward (:mod:`meshrl.trainer.forward`) name no
speed module: they ask the run's :class:`SpeedPath`, chosen once per run (:func:`make_speed_path`) by the device and
``train.speed``:

==============  ====================================================================================================
path            what it turns on
==============  ====================================================================================================
``plain``       nothing: the model's own forward over one padded pass per micro-batch, whole logits. The reference
                every faster path is tested equal to (``tests/integration/test_speed_paths.py``).
``cpu``         shared prompts and packed responses (:mod:`meshrl.trainer.shared_prompts`), the chunked output head
                (:mod:`meshrl.trainer.head`), lean activations (:mod:`meshrl.trainer.lean_activations`), float32
                attention under bf16 autocast (:mod:`meshrl.trainer.float32_attention`), and the C heap's memory
                management (a fixed mmap threshold, free pages handed back after each update,
                :mod:`meshrl.forkpool`); each also behind its ``train.*`` setting.
``cuda``        the same forward savings but float32 attention (it pays on a CPU only) and no C heap management (the
                tensors live in the device's caching allocator).
==============  ====================================================================================================

The update engines (:mod:`meshrl.trainer.update`: serial, or the CPU's forked parts) and the rollout backends
(:mod:`meshrl.rollout`: on CUDA the static decoder with CUDA graphs) are the other two seams; a path here does not
choose them. Every path computes the same values up to float rounding; ``plain`` and ``cpu`` differ by the
rounding of the shared-prompt and chunked-head forms only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

SPEED_PATHS = ("auto", "plain")


@dataclass(frozen=True)
class SpeedPath:
    """The run's speed choices (see the module docstring); build with :func:`make_speed_path`."""

    name: str
    share_prompts: bool
    pack_responses: bool
    length_buckets: int
    head_chunk: int
    head_keep_mib: int
    lean_activations: bool
    float32_attention: bool
    heap_mmap_kib: int
    release_heap: bool

    @contextlib.contextmanager
    def graph_forward(self, model: torch.nn.Module) -> Iterator[None]:
        """Around a forward of the update (both contexts are no-ops without a graph)."""
        from meshrl.trainer.float32_attention import float32_attention
        from meshrl.trainer.lean_activations import lean_activations

        with lean_activations(model, self.lean_activations), float32_attention(self.float32_attention):
            yield

    def forward_logits(self, model: torch.nn.Module, mb: Any, autocast_bf16: bool) -> torch.Tensor:
        """Float32 response logits ``[n, T, V]`` (:func:`meshrl.trainer.batch.response_logits`) in this path's
        layout: prompts shared and responses packed, or one padded pass."""
        from meshrl.trainer.batch import response_logits

        with self.graph_forward(model):
            return response_logits(model, mb, autocast_bf16, share_prompts=self.share_prompts,
                                   pack=self.pack_responses, length_buckets=self.length_buckets)

    def chunks_head(self, model: torch.nn.Module) -> bool:
        """Whether log-probs come from chunks of the head (``head_chunk`` > 0 and a head that can be set aside)."""
        from meshrl.trainer.head import output_head

        return self.head_chunk > 0 and output_head(model) is not None

    def chunked_token_terms(self, model: torch.nn.Module, mb: Any, hidden_of, *, entropy: bool, autocast_bf16: bool,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs and (``entropy``) entropies from chunks of the head (:mod:`meshrl.trainer.head`):
        ``hidden_of(model)`` runs the forward with the head set aside, so it returns the head's input."""
        from meshrl.trainer.head import chunked_token_terms, head_set_aside

        with head_set_aside(model) as head:
            hidden = hidden_of(model)
        return chunked_token_terms(hidden, mb.response_ids, head, chunk=self.head_chunk, entropy=entropy,
                                   autocast_bf16=autocast_bf16, temperature=temperature, keep_mib=self.head_keep_mib,
                                   positions=mb.attention_mask[:, mb.prompt_len :].bool())  # not the padding

    def at_start(self) -> None:
        """Before the model's tensors exist: the C heap's mmap threshold (``train.heap_mmap_kib``)."""
        from meshrl.forkpool import set_heap_mmap_threshold

        if self.heap_mmap_kib:
            set_heap_mmap_threshold(self.heap_mmap_kib)

    def after_update(self) -> None:
        """The update's activations and gradients are free: hand the C heap's free pages back. glibc keeps them
        resident and the next rollout's allocations rarely fit those holes: without this the peak rose ~0.5 GB over
        8 steps of SmolLM2-135M on a CPU (benchmarks/JOURNAL.md, "Memory: same problems, no growth, leaner
        update"); with it, it stays flat. No value
        changes."""
        from meshrl.forkpool import release_free_heap

        if self.release_heap:
            release_free_heap()


def make_speed_path(train: Any) -> SpeedPath:
    """The path for ``train`` (a :class:`meshrl.trainer.config.TrainConfig`): ``plain`` when ``train.speed`` asks
    for it, else by ``train.device``'s type (``cuda`` or ``cpu``), each saving behind its own setting."""
    from meshrl.models import resolve_device

    if train.speed not in SPEED_PATHS:
        raise ValueError(f"train.speed must be one of {', '.join(SPEED_PATHS)}, got {train.speed!r}")
    if train.speed == "plain":
        return SpeedPath("plain", share_prompts=False, pack_responses=False, length_buckets=1, head_chunk=0,
                         head_keep_mib=0, lean_activations=False, float32_attention=False, heap_mmap_kib=0,
                         release_heap=False)
    cuda = resolve_device(train.device).type == "cuda"
    return SpeedPath("cuda" if cuda else "cpu", share_prompts=train.share_prompts, pack_responses=train.pack_responses,
                     length_buckets=train.length_buckets, head_chunk=train.head_chunk,
                     head_keep_mib=train.head_keep_mib, lean_activations=train.lean_activations,
                     float32_attention=train.float32_attention and not cuda,
                     heap_mmap_kib=0 if cuda else train.heap_mmap_kib, release_heap=not cuda)
