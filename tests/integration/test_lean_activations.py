"""meshrl.trainer.lean_activations: the RMSNorm's and SwiGLU's elementwise intermediates are recomputed in the
backward instead of kept, and nothing else changes: outputs and gradients bit for bit, on several model families,
in float32 and under bf16 autocast, with LoRA, and through a whole training step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from meshrl.trainer import lean_activations as lean_mod
from meshrl.trainer.lean_activations import lean_activations, lean_modules

FAMILIES = ["llama", "llama+bias", "qwen2", "qwen3", "mistral"]


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "llama+bias":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif kind == "qwen3":  # per-head q/k RMSNorms too
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, use_sliding_window=False))
    else:
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    for p in model.parameters():  # norm weights and biases away from 1 / 0, so that a dropped term would show
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, *, lean: bool, autocast: bool | str):
    model.zero_grad(set_to_none=True)
    cache = autocast != "nocache"  # the trainer turns autocast's weight cache off when it runs lean
    with lean_activations(model, lean), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(autocast),
                                                       cache_enabled=cache):
        logits = model(input_ids=ids).logits
    weights = torch.linspace(-1.0, 1.0, logits.shape[-1])
    loss = (logits.float().log_softmax(-1) * weights).sum() / ids.numel()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("autocast", [False, True, "nocache"], ids=["fp32", "bf16-autocast", "bf16-no-cache"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_outputs_and_gradients_are_bit_for_bit_the_plain_forwards(kind, autocast):
    model = _model(kind).train()
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    plain_logits, plain = _loss_and_grads(model, ids, lean=False, autocast=autocast)
    lean_logits, lean = _loss_and_grads(model, ids, lean=True, autocast=autocast)
    assert torch.equal(plain_logits, lean_logits)
    assert plain.keys() == lean.keys() and len(plain) == len(list(model.parameters()))
    for name in plain:
        assert torch.equal(plain[name], lean[name]), name


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_norm_and_mlp_is_run_lean_and_put_back(kind):
    model = _model(kind)
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if kind == "qwen3" else 0)  # qwen3: q_norm and k_norm per layer
    with lean_activations(model) as n:
        assert n == norms + layers
        assert all("forward" in vars(m) for m, _ in lean_modules(model))
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad(), lean_activations(model) as n:  # nothing to save without a graph
        assert n == 0
    with lean_activations(model, enabled=False) as n:
        assert n == 0


def test_the_recomputed_tensors_are_not_held_by_the_graph(monkeypatch):
    """With the graph alive (before the backward), the intermediates given a recipe are freed: autograd keeps the
    recipe, not the tensor. Without lean activations the same tensors are alive."""
    registered: list[weakref.ref] = []
    real = lean_mod._Recipes.register
    monkeypatch.setattr(lean_mod._Recipes, "register", lambda self, t, r: (registered.append(weakref.ref(t)),
                                                                            real(self, t, r))[1])
    model = _model("llama").train()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with lean_activations(model):
        loss = model(input_ids=ids).logits.square().mean()
    gc.collect()
    layers = model.config.num_hidden_layers
    assert len(registered) == (2 * layers + 1) + 2 * layers  # one per norm (fp32: no cast), two per MLP
    assert all(ref() is None for ref in registered)
    loss.backward()  # and the backward still finds what it needs

    kept: list[weakref.ref] = []
    act = model.model.layers[0].mlp.act_fn
    handle = act.register_forward_hook(lambda m, i, out: kept.append(weakref.ref(out)))
    loss = model(input_ids=ids).logits.square().mean()
    gc.collect()
    assert kept and all(ref() is not None for ref in kept)  # the plain forward keeps silu's output for the backward
    handle.remove()
    del loss


def test_lora_adapters_get_the_same_gradients():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # B starts at 0: give the adapter a path for gradients to show differences
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(3))
    _, plain = _loss_and_grads(model, ids, lean=False, autocast=True)
    _, lean = _loss_and_grads(model, ids, lean=True, autocast=True)
    assert plain.keys() == lean.keys() and any("lora_A" in n for n in plain)
    for name in plain:
        assert torch.equal(plain[name], lean[name]), name


@pytest.mark.slow
def test_a_training_step_is_unchanged(tmp_path, monkeypatch):
    from meshrl.trainer import Trainer, load_config

    calls = []
    real = lean_mod.lean_mlp_forward
    monkeypatch.setattr(lean_mod, "lean_mlp_forward", lambda s, m, x: (calls.append(1), real(s, m, x))[1])

    def run(lean: bool, out):
        cfg = load_config(overrides=["model=tiny", "task=tiny:add", "steps=2", "rollout.prompts_per_step=2",
                                     "rollout.group_size=4", "rollout.max_new_tokens=8", "log.progress=false",
                                     "train.autocast_bf16=true", "train.micro_batch_size=3", "optim.lr=1e-3",
                                     "train.update_workers=1", f"train.lean_activations={str(lean).lower()}"])
        trainer = Trainer(cfg, out)
        metrics = [trainer.step() for _ in range(2)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.close()
        return metrics, weights

    plain_m, plain_w = run(False, tmp_path / "plain")
    assert not calls
    lean_m, lean_w = run(True, tmp_path / "lean")
    assert calls  # the update's forwards ran the lean MLP
    for a, b in zip(plain_m, lean_m, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "throughput/"))} == \
               {k: v for k, v in b.items() if not k.startswith(("time/", "throughput/"))}
    assert all(torch.equal(plain_w[n], lean_w[n]) for n in plain_w)


def test_autocasts_of_weights_and_norm_outputs_are_recomputed_not_kept(monkeypatch):
    """Under bf16 autocast every projection saves a bf16 copy of its weight and of its input; those of float32
    parameters and of a norm's output are kept as recipes (a cast of what is kept anyway)."""
    kinds = []
    real = lean_mod._Recipes._cast

    def spy(self, tensor):
        recipe = real(self, tensor)
        if recipe is not None:
            node = tensor.grad_fn
            while node.name() in lean_mod.VIEW_NODES:
                node = node.next_functions[0][0]
            kinds.append("weight" if node.next_functions[0][0].name() == lean_mod.ACCUMULATE else "input")
        return recipe

    monkeypatch.setattr(lean_mod._Recipes, "_cast", spy)
    model = _model("llama").train()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    layers = model.config.num_hidden_layers
    with lean_activations(model), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids).logits.float().mean().backward()
    # 7 projections per layer and the head read a weight cast; q, k, v, gate and up per layer read a norm output's
    # cast (the head reads a cast of a slice of the last norm's output: kept; meshrl's update sets the head aside)
    assert kinds.count("weight") == 7 * layers + 1
    assert kinds.count("input") == 5 * layers


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny:small", "tiny:medium"])
def test_the_updates_shared_prompt_forward_gives_the_same_gradients(tmp_path, model):
    """The update's own forward (prompt pass, packed responses handed its KV cache, head in chunks) under bf16
    autocast: per-row log-probs and every gradient bit for bit, lean or not. A weight read by both passes has one
    autocast copy whose gradient is summed in bf16 either way (casting per use would sum it in float32)."""
    from meshrl.trainer import Trainer, load_config

    cfg = load_config(overrides=[f"model={model}", "task=tiny:add", "steps=1", "rollout.prompts_per_step=3",
                                 "rollout.group_size=4", "rollout.max_new_tokens=12", "log.progress=false",
                                 "train.autocast_bf16=true", "rollout.temperature=1.0"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.step()
    data, fwd = trainer.last_data, trainer.forward

    def grads(lean: bool):
        object.__setattr__(fwd._train, "lean_activations", lean)
        trainer.model.zero_grad(set_to_none=True)
        logps = []
        for _, mb in fwd.micro_batches(list(range(len(data))), data):
            seq = fwd.seq_logp(mb)
            (seq * torch.linspace(-1.0, 1.0, len(seq))).sum().backward()
            logps.append(seq.detach())
        return torch.cat(logps), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    plain_lp, plain = grads(False)
    lean_lp, lean = grads(True)
    trainer.close()
    assert torch.equal(plain_lp, lean_lp)
    assert all(torch.equal(plain[n], lean[n]) for n in plain)
