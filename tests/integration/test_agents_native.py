"""meshrl.agents with a real model: tool-using episodes of ``model=tiny`` through the ``native`` rollout backend
(and ``hf``, ``transformers.generate``).

The untrained tiny model never writes a tool call, so the first turn of each episode is scripted (a calculator
call); every later turn is the native engine sampling from the exact ids so far. Checked: the ids the trainer
would score give, under the model's own forward, the log-probs the engine reported for every token it sampled
(no re-tokenisation drift, the mask on exactly those tokens); the same seed gives the same episodes.
"""

from __future__ import annotations

import pytest
import torch

from meshrl.agents import EpisodeLimits, Toolbox, calculator, encode_agent_prompt, run_episodes
from meshrl.models import load_model
from meshrl.rollout.base import RolloutBackend, Rollouts, SamplingParams
from meshrl.rollout.hf import HFGenerateBackend
from meshrl.rollout.native import NativeDecodeBackend

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10 + 1"}}\n</tool_call>'


class ScriptedFirstTurn(RolloutBackend):
    """Turn 1: the scripted call for every sample (log-prob 0.0, marked as not the engine's); later turns: the
    native backend. Records which ``generate`` calls the engine answered."""

    name = "scripted+native"

    def __init__(self, native: RolloutBackend, tokenizer):
        self.native, self.tokenizer = native, tokenizer
        self.engine_calls: list[tuple[list[list[int]], Rollouts]] = []
        self.first = True

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int) -> Rollouts:
        if not self.first:
            out = self.native.generate(prompt_ids, params, seed=seed)
            self.engine_calls.append(([list(p) for p in prompt_ids], out))
            return out
        self.first = False
        ids = [*self.tokenizer.encode(CALL, add_special_tokens=False), self.tokenizer.eos_token_id]
        rows = [(i, p) for i, p in enumerate(prompt_ids) for _ in range(params.n)]
        return Rollouts(prompt_index=[i for i, _ in rows], prompt_ids=[list(p) for _, p in rows],
                        response_ids=[list(ids) for _ in rows], texts=[CALL] * len(rows),
                        truncated=[False] * len(rows), engine_logprobs=[[0.0] * len(ids) for _ in rows])

    def sync_weights(self, model) -> None:
        self.native.sync_weights(model)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny", seed=0)


def _episodes(tiny, seed: int, engine: str = "native"):
    model, tok = tiny
    inner = NativeDecodeBackend(model, tok, workers=1) if engine == "native" else HFGenerateBackend(model, tok)
    backend = ScriptedFirstTurn(inner, tok)
    prompts = [encode_agent_prompt(tok, q, Toolbox(None, [calculator]).schemas) for q in ("2**10+1?", "Sum?")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=3)
    episodes = run_episodes(backend, prompts, None, tok, params, EpisodeLimits(max_turns=3), seed, tools=[calculator])
    return backend, episodes


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_engine_turns_are_scored_exactly_as_sampled(tiny, engine):
    model, tok = tiny
    backend, episodes = _episodes(tiny, 11, engine)
    assert len(episodes) == 6 and len(backend.engine_calls) >= 1
    assert backend.engine_calls[0][0] == [e.prompt_ids + e.ids[: e.turn_spans[1][0]] for e in episodes]
    for e in episodes:
        assert e.tool_calls[0].content == "1025" and e.tool_calls[0].error is None
        assert e.turns >= 2 and e.end_reason in ("answer", "turn_length", "max_turns", "parse_failure")
        spans = set().union(*(range(*span) for span in e.turn_spans))
        assert [int(t in spans) for t in range(len(e.ids))] == e.model_mask
        full = torch.tensor([e.prompt_ids + e.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), dim=-1)
        start = len(e.prompt_ids)
        engine = [(t, lp) for t, lp in enumerate(e.engine_logprobs) if t >= e.turn_spans[1][0] and e.model_mask[t]]
        assert engine, "the engine sampled no token"
        scored = torch.tensor([logp[start + t - 1, e.ids[t]].item() for t, _ in engine])
        torch.testing.assert_close(scored, torch.tensor([lp for _, lp in engine]), atol=2e-4, rtol=0)


def test_same_seed_same_episodes(tiny):
    def summary(seed):
        return [(e.ids, e.model_mask, e.end_reason) for e in _episodes(tiny, seed)[1]]

    first = summary(5)
    assert first == summary(5) and first != summary(6)
