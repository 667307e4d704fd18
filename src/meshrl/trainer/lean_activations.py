"""Fewer saved activations in the update's forward: two intermediates per layer recomputed in the backward.

Autograd keeps, for the backward, every tensor an operation needs. In a Llama-family decoder layer two kinds of
them are cheap functions of tensors it keeps anyway:

* the RMSNorm's normalised activations ``n = h * rsqrt(mean(h^2) + eps)`` (float32, hidden-wide), which the
  weight multiplication saves, while ``h`` and ``rsqrt(...)`` are saved by the operations that made ``n``;
* the SwiGLU MLP's ``s = silu(g)`` and ``m = s * u`` (intermediate-wide), saved by the multiplication and the down
  projection, while ``g`` and ``u`` are saved by ``silu`` and the multiplication.

Here each such module runs the same operations as its Hugging Face forward, under a
:func:`torch.autograd.graph.saved_tensors_hooks` pair that stores those tensors as a recipe over the kept ones and
recomputes them (elementwise, no matmul) when the backward unpacks them: the selective recomputation of Korthikanti
et al. 2022 ("Reducing activation recomputation in large transformer models"), restricted to elementwise terms.
The recomputed values are bit for bit the forward's (same kernels, same inputs), so gradients are unchanged
(tests/integration/test_lean_activations.py, against the plain forward on several model families).

Per layer and token that is ``2 x hidden x 4 + 2 x intermediate x b`` bytes less (b = 2 under bf16 autocast): for
SmolLM2-135M (576 / 1536, 30 layers) 10.8 KB, ~0.45 GB on a GRPO batch of 32 x 48 response tokens (measured in
benchmarks/README.md, "Memory").

Only module classes whose forward is known to be exactly the one re-run here are touched (:data:`NORM_CLASSES`,
:data:`MLP_CLASSES`); anything else runs its own forward. Used for forwards that build a graph
(:meth:`meshrl.trainer.forward.PolicyForward.logits`), not with gradient checkpointing (which recomputes more).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Hugging Face classes whose forward is ``weight * (h * rsqrt(mean(h^2) + eps)).to(input_dtype)`` with h = x.float()
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
# ... and ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


class _Recipes:
    """The pack / unpack pair of a saved-tensors hook: a saved tensor whose storage was registered with a recipe is
    kept as that recipe (plus the view autograd saved) and recomputed, without a graph, when unpacked."""

    def __init__(self, device_type: str) -> None:
        self.recipes: dict[int, Callable[[], torch.Tensor]] = {}
        # the backward runs outside the forward's autocast: recompute under the state the forward ran in
        self.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))

    def register(self, tensor: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> None:
        # The caller holds ``tensor`` until the hooks are removed, so its storage address is not reused meanwhile.
        self.recipes[tensor.untyped_storage().data_ptr()] = recipe

    def pack(self, tensor: torch.Tensor):
        recipe = self.recipes.get(tensor.untyped_storage().data_ptr()) if tensor.device.type != "meta" else None
        if recipe is None:
            return tensor
        return recipe, tensor.size(), tensor.stride(), tensor.storage_offset()

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, size, stride, offset = packed
        device_type, dtype, enabled = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return recipe().as_strided(size, stride, offset)

    @contextmanager
    def hooks(self) -> Iterator[_Recipes]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


def lean_rmsnorm_forward(norm: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm forward, its normalised activations kept as a recipe."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    inv = torch.rsqrt(variance + norm.variance_epsilon)
    with _Recipes(h.device.type).hooks() as saved:
        normed = h * inv
        saved.register(normed, lambda: h * inv)
        cast = normed.to(input_dtype)
        if cast is not normed:
            saved.register(cast, lambda: (h * inv).to(input_dtype))
        return norm.weight * cast


def lean_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's SwiGLU MLP forward, ``act_fn(gate)`` and its product with ``up`` kept as recipes."""
    gate = mlp.gate_proj(x)
    up = mlp.up_proj(x)
    act = mlp.act_fn
    with _Recipes(gate.device.type).hooks() as saved:
        activated = act(gate)
        saved.register(activated, lambda: act(gate))
        product = activated * up
        saved.register(product, lambda: act(gate) * up)
        return mlp.down_proj(product)


def lean_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable]]:
    """``(module, lean forward)`` for every module of ``model`` this file knows how to run leaner."""
    out = []
    for module in model.modules():
        name = type(module).__name__
        if name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            out.append((module, lean_rmsnorm_forward))
        elif name in MLP_CLASSES and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            out.append((module, lean_mlp_forward))
    return out


@contextmanager
def lean_activations(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Run ``model``'s known RMSNorm and MLP modules with :func:`lean_rmsnorm_forward` / :func:`lean_mlp_forward`
    for the duration (an instance attribute ``forward`` shadows the class's); yields how many modules that is.
    A no-op when not ``enabled``, without a graph, or under gradient checkpointing."""
    active = enabled and torch.is_grad_enabled() and not _checkpointing(model)
    swapped = lean_modules(model) if active else []
    for module, forward in swapped:
        module.forward = types.MethodType(forward, module)
    try:
        yield len(swapped)
    finally:
        for module, _ in swapped:
            del module.forward


def _checkpointing(model: torch.nn.Module) -> bool:
    """Gradient checkpointing recomputes whole layers with its own saved-tensor hooks: leave it alone."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
