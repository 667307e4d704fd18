"""Fewer saved activations in the update's forward: tensors autograd would keep are recomputed in the backward.

Autograd keeps, for the backward, every tensor an operation needs. In a Llama-family decoder layer several of
them are cheap functions of tensors it keeps anyway:

* the RMSNorm's normalised activations ``n = h * rsqrt(mean(h^2) + eps)`` (float32, hidden-wide), which the
  weight multiplication saves, while ``h`` and ``rsqrt(...)`` are saved by the operations that made ``n``;
* the SwiGLU MLP's ``s = silu(g)`` and ``m = s * u`` (intermediate-wide), saved by the multiplication and the down
  projection, while ``g`` and ``u`` are saved by ``silu`` and the multiplication;
* under autocast, the low-precision copies each projection makes and saves of its float32 weight and of its
  float32 input (q, k and v each cast the same norm output: three copies): casts of a parameter, or of a norm's
  output, which is itself a recipe over ``h``, ``rsqrt(...)`` and the norm's weight.

Here the norm and MLP modules run the same operations as their Hugging Face forwards, and the whole forward runs
under a :func:`torch.autograd.graph.saved_tensors_hooks` pair that stores those tensors as recipes and recomputes
them (elementwise or a cast, never a matmul) when the backward unpacks them: the selective recomputation of
Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer models"), restricted to cheap
terms. The recomputed values are bit for bit the forward's (same kernels, same inputs), so outputs and gradients
are unchanged (tests/integration/test_lean_activations.py, against the plain forward on several model families).

Per layer and token of SmolLM2-135M (hidden 576, intermediate 1536) under bf16 autocast that is 16.5 KB less, and
the bf16 copy of the weights (0.27 GB) is no longer held through the backward; measured in benchmarks/JOURNAL.md
("Memory: same problems, no growth, leaner update"). The cost is a second cast of each weight per pass in the
backward.

Only module classes whose forward is known to be exactly the one re-run here are touched (:data:`NORM_CLASSES`,
:data:`MLP_CLASSES`); anything else runs its own forward. Used for forwards that build a graph
(:meth:`meshrl.trainer.forward.PolicyForward.logits`), not with gradient checkpointing (which recomputes more).
A recipe reads the parameters at the backward: they must not change between a forward and its backward (an
optimiser step never falls in between in meshrl's update).
"""


from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Hugging Face classes whose forward is ``weight * (h * rsqrt(mean(h^2) + eps)).to(input_dtype)`` with h = x.float()
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
# ... and ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


# Autograd nodes of operations whose output is always a view of their input (same storage, never a copy).
VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                        "AliasBackward0", "ExpandBackward0", "SqueezeBackward0", "SqueezeBackward1",
                        "UnsqueezeBackward0"})
ACCUMULATE = "torch::autograd::AccumulateGrad"


class _Recipes:
    """The pack / unpack pair of a saved-tensors hook over one forward. A saved tensor kept as a recipe (plus the
    size, stride and offset autograd saved it with) is recomputed, without a graph, when the backward unpacks it:

    * a tensor a lean forward registered (:meth:`register`), and views of it;
    * a low-precision cast (autocast's) of a float32 parameter, or of a tensor registered as a source
      (:meth:`register_source`: a norm's output), found by walking the saved tensor's autograd history back
      through view-only operations to the cast.
    """

    def __init__(self, device_type: str) -> None:
        # storage address -> (weak reference to the registered tensor, recipe). The reference is checked on use: a
        # freed tensor's address may be reused by another tensor, which must not inherit its recipe.
        self.tensors: dict[int, tuple[weakref.ref, Callable[[], torch.Tensor]]] = {}
        self.sources: dict[object, Callable[[], torch.Tensor]] = {}  # autograd node -> recipe of its output
        # the backward runs outside the forward's autocast: recompute under the state the forward ran in
        self.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))

    def register(self, tensor: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> None:
        self.tensors[tensor.untyped_storage().data_ptr()] = (weakref.ref(tensor), recipe)

    def register_source(self, tensor: torch.Tensor, recipe: Callable[[], torch.Tensor]) -> None:
        if tensor.grad_fn is not None:
            self.sources[tensor.grad_fn] = recipe

    def pack(self, tensor: torch.Tensor):
        recipe = self._registered(tensor) or self._cast(tensor)
        if recipe is None:
            return tensor
        return recipe, tensor.size(), tensor.stride(), tensor.storage_offset()

    def _registered(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        entry = self.tensors.get(tensor.untyped_storage().data_ptr())
        return entry[1] if entry is not None and entry[0]() is not None else None

    def _cast(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        if tensor.dtype not in (torch.bfloat16, torch.float16):
            return None
        node = tensor.grad_fn
        while node is not None and node.name() in VIEW_NODES:
            node = node.next_functions[0][0]
        if node is None or node.name() != "ToCopyBackward0":
            return None
        source, dtype = node.next_functions[0][0], tensor.dtype
        if source is not None and source.name() == ACCUMULATE:
            param = source.variable
            if param.dtype != torch.float32 or not param.is_contiguous():
                return None
            return lambda: param.to(dtype)
        recipe = self.sources.get(source)
        return None if recipe is None else (lambda: recipe().to(dtype))

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, size, stride, offset = packed
        device_type, dtype, enabled = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return recipe().as_strided(size, stride, offset)


def lean_rmsnorm_forward(saved: _Recipes, norm: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm forward, its normalised activations and its output kept as recipes."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    inv = torch.rsqrt(variance + norm.variance_epsilon)
    normed = h * inv
    saved.register(normed, lambda: h * inv)
    cast = normed.to(input_dtype)
    if cast is not normed:
        saved.register(cast, lambda: (h * inv).to(input_dtype))
    weight = norm.weight
    out = weight * cast
    # not saved as such, but cast by the projections that read it (autocast): those casts become recipes
    saved.register_source(out, lambda: weight * (h * inv).to(input_dtype))
    return out


def lean_mlp_forward(saved: _Recipes, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's SwiGLU MLP forward, ``act_fn(gate)`` and its product with ``up`` kept as recipes."""
    gate = mlp.gate_proj(x)
    up = mlp.up_proj(x)
    act = mlp.act_fn
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
    from meshrl.trainer.shared_prompts import checkpointing  # its own saved-tensor hooks: leave it alone

    active = enabled and torch.is_grad_enabled() and not checkpointing(model)
    swapped = lean_modules(model) if active else []
    if not swapped:
        yield 0
        return
    param = next(model.parameters())
    saved = _Recipes(param.device.type)
    for module, forward in swapped:
        module.forward = types.MethodType(functools.partial(forward, saved), module)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            yield len(swapped)
    finally:
        for module, _ in swapped:
            del module.forward
