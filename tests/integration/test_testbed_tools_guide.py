"""Coach-guided exploration (``plugins.coach_guide``) on tool-using episodes: the calculator plan's rollouts are
sampled under the unconditioned prompt with their first model turn forced to open a tool call; the direct plan
has nothing to force (free rollouts); the forced tokens are counted for the off-policy loss and the episodes
run on as usual."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import ScriptedBackend  # noqa: E402

import meshrl.testbed  # noqa: E402,F401  (registers testbed:tools)
from meshrl.agents import run_episodes  # noqa: E402
from meshrl.models.tiny import build_char_tokenizer  # noqa: E402
from meshrl.rollout import SamplingParams  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402
from meshrl.testbed.tools_task import COACH_PLANS, OPEN_CALL, call_text  # noqa: E402
from meshrl.trainer import Trainer, load_config  # noqa: E402


def _script(tok, answers: dict[str, str]):
    """After ``<tool_call>``: the rest of the call; after the tool's response: the answer; else the answer at once."""

    def script(context: list[int], row: int, seed: int) -> str:
        text = tok.decode(context, skip_special_tokens=False)
        question = text.split("<s>user\n")[1].split("</s>")[0]
        if text.endswith(OPEN_CALL):
            return call_text(question).removeprefix(OPEN_CALL)
        return answers[question]

    return script


def test_openings_are_forced_tokens_of_the_first_turn():
    task = load_task("testbed:tools", size=4, eval_size=2)
    tok = build_char_tokenizer()
    problems = task.problems("train")[:2]
    answers = {p.prompt: p.answer for p in problems}
    prompts = [task.encode_prompt(tok, p.prompt) for p in problems]
    opening = list(tok.encode(OPEN_CALL, add_special_tokens=False))
    params = SamplingParams(task.max_new_tokens, n=2)
    backend = ScriptedBackend(tok, _script(tok, answers))
    episodes = run_episodes(backend, prompts, None, tok, params, task.limits, seed=1, tools=task.tools,
                            openings=[opening, []])
    guided, free = episodes[:2], episodes[2:]
    for episode in guided:
        assert episode.ids[: len(opening)] == opening and episode.model_mask[: len(opening)] == [1] * len(opening)
        assert episode.engine_logprobs is None and [c.name for c in episode.tool_calls] == ["calculator"]
        assert episode.final_text == answers[problems[0].prompt] and episode.turns == 2
        assert len(episode.ids[slice(*episode.turn_spans[0])]) <= params.max_new_tokens  # opening within the turn
    for episode in free:
        assert episode.tool_calls == [] and episode.engine_logprobs is not None
    first_calls = [call for call in backend.calls if call[1].n == 2]
    assert {call[1].max_new_tokens for call in first_calls} == {params.max_new_tokens,
                                                                 params.max_new_tokens - len(opening)}
    assert run_episodes(backend, prompts, None, tok, params, task.limits, seed=1, tools=task.tools)[2].ids == \
        free[0].ids  # the free prompts keep the plain call's seed
    with pytest.raises(ValueError, match="not less than the turn's max_new_tokens"):
        run_episodes(backend, prompts, None, tok, params, task.limits, seed=1, tools=task.tools,
                     openings=[[5] * params.max_new_tokens, []])


def test_a_guided_step_on_testbed_tools(tmp_path):
    cfg = load_config(overrides=[
        "model=tiny", "task=testbed:tools", "steps=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=72", "train.micro_batch_size=8", "log.progress=false", "checkpoint.every=100",
        "recipe=cp_only", "mesh.m=2", "mesh.template=plain", "mesh.adv_unit=query", "plugins.coach_guide.enabled=true",
        "plugins.coach_guide.shape=log", "train.update_workers=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        tok = trainer.tokenizer
        answers = {p.prompt: p.answer for p in trainer.problems}
        trainer.sampler.backend = ScriptedBackend(tok, _script(tok, answers))
        metrics = trainer.step()
        data = trainer.last_data
        opening = len(tok.encode(OPEN_CALL, add_special_tokens=False))
        assert data.unsampled == [opening if k == 0 else 0 for k in data.strategy_ids]
        assert data.origin == ["coach_guide" if k == 0 else "" for k in data.strategy_ids]
        for prompt in data.prompt_ids:  # every arm under the unconditioned prompt
            assert not any(plan in tok.decode(prompt) for plan in COACH_PLANS.values())
        calls = [0 in mask for mask in data.response_masks]
        assert calls == [k == 0 for k in data.strategy_ids]
        assert metrics["guide/rows"] == 4 and metrics["guide/score_guided"] == 1.0
        assert metrics["free/strategy/mass/direct"] == 1.0 and "guide/logp_mean" in metrics
    finally:
        trainer.close()
