"""meshrl.trainer.speed: the run's speed path is chosen once, by device and ``train.speed``; the step and the
update's forward name no speed module; the fast CPU path gives the plain reference's log-probs and gradients up to
float rounding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from meshrl.testing import tiny_config
from meshrl.trainer.speed import make_speed_path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshrl" / "trainer"
SPEED_MODULES = {"meshrl.trainer.lean_activations", "meshrl.trainer.float32_attention", "meshrl.trainer.head",
                 "meshrl.trainer.shared_prompts", "meshrl.forkpool", "meshrl.trainer.parallel_update"}


@pytest.mark.parametrize("module", ["forward.py", "step.py"])
def test_the_step_and_the_forward_name_no_speed_module(module):
    tree = ast.parse((SRC / module).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & SPEED_MODULES, imported & SPEED_MODULES
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"release_free_heap", "set_heap_mmap_threshold", "response_logits", "lean_activations",
                        "float32_attention", "head_set_aside"}


def test_paths_by_device_and_setting(monkeypatch):
    cpu = make_speed_path(tiny_config().train)
    assert cpu.name == "cpu" and cpu.share_prompts and cpu.head_chunk > 0 and cpu.release_heap
    plain = make_speed_path(tiny_config("train.speed=plain").train)
    assert plain.name == "plain" and not (plain.share_prompts or plain.head_chunk or plain.lean_activations
                                          or plain.float32_attention or plain.release_heap)
    off = make_speed_path(tiny_config("train.share_prompts=false", "train.head_chunk=0").train)
    assert off.name == "cpu" and not off.share_prompts and off.head_chunk == 0  # each saving has its setting
    import meshrl.models

    monkeypatch.setattr(meshrl.models, "resolve_device", lambda spec, where="train.device": torch.device("cuda"))
    cuda = make_speed_path(tiny_config().train)
    assert cuda.name == "cuda" and cuda.share_prompts and not cuda.float32_attention and not cuda.release_heap
    with pytest.raises(ValueError, match="train.speed"):
        make_speed_path(tiny_config("train.speed=fast").train)


def _grads(trainer, data) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    fwd = trainer.forward
    logps = fwd.logps(trainer.model, data)
    trainer.model.zero_grad(set_to_none=True)
    for _, mb in fwd.micro_batches(list(range(len(data))), data):
        fwd.seq_logp(mb).sum().backward()
    return logps, [p.grad.clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("bf16", [False, True])
def test_the_cpu_path_equals_the_plain_reference(tmp_path, bf16):
    from meshrl.trainer import Trainer

    extra = ["train.autocast_bf16=true"] if bf16 else []
    fast = Trainer(tiny_config(*extra), tmp_path / "fast")
    plain = Trainer(tiny_config("train.speed=plain", *extra), tmp_path / "plain")
    try:
        assert all(torch.equal(a, b) for a, b in zip(fast.model.parameters(), plain.model.parameters(), strict=True))
        assert fast.speed.name == "cpu" and plain.speed.name == "plain"
        data, _ = fast.plugins.sample(fast.sampler, 0, 0)
        (lp_fast, g_fast), (lp_plain, g_plain) = _grads(fast, data), _grads(plain, data)
    finally:
        fast.close()
        plain.close()
    tol = 3e-2 if bf16 else 1e-5
    for a, b in zip(lp_fast, lp_plain, strict=True):
        assert torch.allclose(a, b, atol=tol), (a - b).abs().max()
    for a, b in zip(g_fast, g_plain, strict=True):
        assert torch.allclose(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=tol), (a - b).abs().max()
