"""Micro-batches follow the policy's device (``train.device``): the loss multiplies the response mask into the
model's logits, so a batch left on the host fails on a GPU. A CPU cannot run a GPU, but the ``meta`` device shows
where every tensor goes."""

from __future__ import annotations

import torch

from meshrl.trainer.batch import collate
from meshrl.trainer.forward import PolicyForward


def test_microbatch_to_moves_every_tensor_and_keeps_itself_on_its_device():
    mb = collate([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0, model_masks=[[1, 0, 1], None])
    assert mb.to(torch.device("cpu")) is mb
    moved = mb.to(torch.device("meta"))
    for name in ("input_ids", "attention_mask", "position_ids", "response_ids", "response_mask"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(mb, name).shape
    assert moved.prompt_len == mb.prompt_len


class _Cfg:
    class rollout:  # noqa: N801 - a stand-in for the run config's sections
        temperature = 1.0

    class train:  # noqa: N801
        micro_batch_size = 2
        head_chunk = 0
        speed, device = "plain", "cpu"


class _Data:
    prompt_ids = [[1, 2], [3]]
    response_ids = [[4, 5], [6, 7, 8]]
    response_masks = None
    problems = [None, None]


def test_policy_forward_places_micro_batches_on_the_models_device():
    model = torch.nn.Linear(2, 2, device="meta")
    fwd = PolicyForward(_Cfg, model, None, pad_id=0, bare_prompt=lambda p: [])
    (idx, mb), = list(fwd.micro_batches([0, 1], _Data))
    assert idx == [0, 1] and mb.response_mask.device.type == "meta" and mb.input_ids.device.type == "meta"
    assert fwd.collate([[1]], [[2, 3]]).response_ids.device.type == "meta"
    cpu = PolicyForward(_Cfg, torch.nn.Linear(2, 2), None, pad_id=0, bare_prompt=lambda p: [])
    (_, mb_cpu), = list(cpu.micro_batches([0, 1], _Data))
    assert torch.equal(mb_cpu.response_ids, torch.tensor([[4, 5, 0], [6, 7, 8]]))
