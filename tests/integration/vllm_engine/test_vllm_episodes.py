"""Multi-turn, tool-using episodes sampled by vLLM's CPU build (run in .venv-vllm; skipped without vLLM).

A tiny model is first taught (teacher forcing on episodes a scripted sampler assembled, tool output masked) to call
the calculator and then answer; vLLM then samples its episodes turn by turn. The trainer's forward over the
assembled ids must reproduce vLLM's log-probs of every token the model sampled, in the second turn too (after the
tool's output, which vLLM never sampled): the episodes are token-exact, not re-rendered text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_probe import MATCH_TOL  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
from agents_support import ScriptedBackend, call_text  # noqa: E402

from meshrl.trainer import Trainer, load_config  # noqa: E402
from meshrl.trainer.batch import collate, response_logits, token_logprobs  # noqa: E402

TASK = "task=env:calculator?max_turns=3&data=tiny:repeat"
RUN = ["model=tiny:small", TASK, "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=96",
       "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=100", "train.update_workers=1",
       "rollout.decode_workers=1", "seed=0",
       "rollout.temperature=0.5"]  # sharper than the taught model's own distribution: most episodes parse
CALL = call_text("calculator", {"expression": "2+3"})


def _teach_tool_use(tmp_path: Path) -> Path:
    """tiny:small taught the episode "call the calculator, then answer 'done'" on exactly the ids a step assembles."""
    cfg = load_config(overrides=[*RUN, "steps=1", "optim.lr=1e-3"])
    trainer = Trainer(cfg, tmp_path / "script_run")
    try:
        tok = trainer.tokenizer
        trainer.sampler.backend = ScriptedBackend(
            tok, lambda ctx, row, seed: "done" if "<s>tool\n" in tok.decode(ctx) else CALL)
        trainer.step()
        data = trainer.last_data
        model = trainer.model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch.manual_seed(0)
        for _ in range(400):
            mb = collate(data.prompt_ids, data.response_ids, tok.pad_token_id, data.response_masks)
            lp = token_logprobs(response_logits(model, mb), mb.response_ids, 1.0)
            loss = -(lp * mb.response_mask).sum() / mb.response_mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if float(loss.detach()) < 0.005:
                break
        assert float(loss.detach()) < 0.005, float(loss.detach())
        out = tmp_path / "tool_model"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        return out
    finally:
        trainer.close()


def test_vllm_samples_token_exact_tool_using_episodes(tmp_path):
    model_dir = _teach_tool_use(tmp_path)
    cfg = load_config(overrides=[*RUN, f"model={model_dir}", "rollout.backend=vllm", "steps=1", "optim.lr=1e-2"])
    trainer = Trainer(cfg, tmp_path / "vllm_run")
    try:
        assert trainer.backend.name == "vllm"
        metrics = trainer.step()
        data = trainer.last_data
    finally:
        trainer.close()
    two_turn = [i for i, m in enumerate(data.response_masks) if m is not None and 0 in m]
    assert metrics["tools/calls_mean"] >= 0.5 and len(two_turn) >= 4, metrics  # most episodes called the tool
    assert metrics["turns/mean"] > 1.5 and metrics["strategy/mass/calculator"] >= 0.5
    for i in two_turn:  # the model's tokens follow the tool output: vLLM sampled both turns
        mask = data.response_masks[i]
        assert mask[0] == 1 and mask[-1] == 1 and mask.index(0) < len(mask) - 1 - mask[::-1].index(0)
    # the trainer's pi_old of every model token (the second turn's included) equals vLLM's log-prob of it
    assert metrics["mismatch/logp_absdiff_max"] < MATCH_TOL, metrics["mismatch/logp_absdiff_max"]
