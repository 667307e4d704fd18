"""Small, fast runs for tests: the built-in tiny model on ``tiny:repeat`` (seconds per step on a CPU).

For meshrl's own tests and for anyone testing a plug-in of their own (docs/plugins.md, "Writing a plug-in")::

    from meshrl.testing import tiny_config
    from meshrl.trainer import train

    history = train(tiny_config("plugins.fork.enabled=true", steps=2), tmp_path / "run")

Later overrides win, so a test states only what it changes.
"""

from __future__ import annotations

from typing import Any

# 4 problems x 4 rollouts of up to 6 tokens, one micro-batch, no progress bar; checkpoints every 100 steps and
# after the last one (a short run writes one checkpoint, at its end).
TINY_RUN = ("model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "train.micro_batch_size=16", "log.progress=false", "checkpoint.every=100",
            "optim.lr=1e-3")


def tiny_config(*overrides: str, steps: int = 2) -> Any:
    """A validated :class:`meshrl.trainer.RunConfig` of the tiny run with ``overrides`` (``key=value``) applied
    after ``steps`` (so ``"steps=5"`` among the overrides wins over the keyword)."""
    from meshrl.trainer import load_config

    return load_config(overrides=[*TINY_RUN, f"steps={steps}", *overrides])


def family_model(kind: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a randomly initialised 2-layer model of a Llama-family type other than the tiny
    one, with the tiny tokenizer, for tests of code that reads a model's layout (the native decoder). ``kind``:
    ``qwen2`` (q/k/v biases), ``qwen3`` (per-head q/k RMSNorm, explicit head_dim), ``llama+bias`` (biases on every
    projection), anything else a Llama with a non-default RoPE base and an untied head. Every parameter gets
    random noise (biases and norm weights too), so that a dropped term would show."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from meshrl.models import build_tiny

    _, tok = build_tiny("tiny")
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, use_sliding_window=False))
    elif kind == "llama+bias":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=500.0, tie_word_embeddings=False))
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    return model.eval(), tok
