"""``testbed:tools``: problem types, answers and ground truth, the tool-pattern labels, disjoint splits, and the
warm start's episodes token for token against what ``run_episodes`` assembles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agents_support import ScriptedBackend  # noqa: E402

import meshrl.testbed  # noqa: E402,F401  (registers testbed:tools)
from meshrl.agents import ToolResponseRenderer, run_episodes  # noqa: E402
from meshrl.models.tiny import build_char_tokenizer  # noqa: E402
from meshrl.rollout import SamplingParams  # noqa: E402
from meshrl.tasks import load_task  # noqa: E402
from meshrl.testbed.tools_task import (  # noqa: E402
    HOME,
    TOOLS_LINE,
    ToolsTestbed,
    call_text,
    is_eval_pair,
    make_problem,
    pair_pool,
    parse_mix,
)
from meshrl.testbed.tools_warm import EpisodeExamples, pad_episodes, reference_episode, tools_warm_settings  # noqa: E402
from meshrl.trainer.episodes import transcript  # noqa: E402


@pytest.fixture(scope="module")
def task() -> ToolsTestbed:
    return load_task("testbed:tools", size=40, eval_size=16)


def test_types_answers_and_ground_truth():
    add, mul = make_problem("add", 457, 8), make_problem("mul", 457, 38)
    assert (add.prompt, add.answer, add.meta["home"], add.meta["needs_tool"]) == ("457+8", "465", "direct", False)
    assert (mul.prompt, mul.answer, mul.meta["home"], mul.meta["needs_tool"]) == ("457*38", "17366", "calculator",
                                                                                    True)
    assert HOME == {"add": "direct", "mul": "calculator"}
    with pytest.raises(ValueError, match="mul operands must be in"):
        make_problem("mul", 45, 38)
    with pytest.raises(ValueError, match="unknown problem type 'div'"):
        make_problem("div", 457, 8)


def test_mix_and_options_are_checked():
    assert parse_mix("add:3,mul:1") == {"add": 0.75, "mul": 0.25}
    with pytest.raises(ValueError, match=r"unknown problem type\(s\) \['sub'\]"):
        parse_mix({"sub": 1.0})
    with pytest.raises(ValueError, match="mix must look like"):
        parse_mix("add=1")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['budget'\]"):
        load_task("testbed:tools", budget=3)


def test_the_niche_is_a_minority_and_types_follow_the_mix(task):
    kinds = [p.meta["type"] for p in task.problems("train")]
    assert kinds.count("mul") == 10 and kinds.count("add") == 30
    assert len({p.id for p in task.problems("train")}) == 40


def test_train_and_eval_pairs_are_disjoint_for_every_seed():
    pools = pair_pool(False), pair_pool(True)
    for kind in ("add", "mul"):
        assert not set(pools[0][kind]) & set(pools[1][kind])
        assert 0.08 < len(pools[1][kind]) / (len(pools[0][kind]) + len(pools[1][kind])) < 0.17  # one in 8
    for seed in (0, 1):
        t = ToolsTestbed(seed=seed, size=300, eval_size=64)
        train = {(p.meta["type"], p.meta["a"], p.meta["b"]) for p in t.problems("train")}
        held = {(p.meta["type"], p.meta["a"], p.meta["b"]) for p in t.problems("eval")}
        assert all(is_eval_pair(*k) for k in held) and not any(is_eval_pair(*k) for k in train)
    other = ToolsTestbed(seed=1, size=300, eval_size=64)
    assert [p.id for p in other.problems("train")] != [p.id for p in ToolsTestbed(seed=0, size=300).problems("train")]


def test_the_reward_is_the_exact_final_answer(task):
    problem = make_problem("mul", 457, 38)
    assert task.score("17366", problem) == 1.0
    for wrong in ("17366 ", "17365", "=17366", "", "17366\n"):
        assert task.score(wrong, problem) == 0.0


def test_labels_are_tool_patterns(task):
    problem = make_problem("mul", 457, 38)
    assert task.label_strategy(call_text(problem.prompt) + "\n17366") == "calculator"
    assert task.label_strategy("17366") == "direct"
    assert task.label_strategy('<tool_call>{"name":"calculator","arguments":{"expression":"1"}}</tool_call>') is None
    assert task.label_strategy("<tool_call>oops") is None
    assert task.strategies == ("direct", "calculator")


def test_the_prompt_is_compact_and_keeps_a_coach_plan(task):
    tok = build_char_tokenizer()
    problem = make_problem("add", 457, 8)
    plain = tok.decode(task.encode_prompt(tok, task.format_prompt(problem)))
    assert plain == f"<s>system\n{TOOLS_LINE}</s>\n<s>user\n457+8</s>\n<s>assistant\n" and len(plain) < 70
    coached = tok.decode(task.encode_prompt(tok, "457+8", system="Answer directly, without tools."))
    assert coached.startswith(f"<s>system\nAnswer directly, without tools.\n{TOOLS_LINE}</s>")
    assert task.coach_strategies(problem) == ["Call the calculator tool first.", "Answer directly, without tools."]


@pytest.mark.parametrize("pattern", ["calculator", "direct"])
@pytest.mark.parametrize("system", [None, "Call the calculator tool first."])
def test_warm_start_episodes_are_the_ids_run_episodes_assembles(task, pattern, system):
    """The model samples the reference turns (a scripted backend); the episode's prompt, ids and mask equal the
    warm start's example, so teacher forcing trains on exactly what the trainer will score."""
    tok = build_char_tokenizer()
    problems = [make_problem("mul", 457, 38), make_problem("add", 999, 9)]
    turns = {p.prompt: task.reference_turns(p, pattern) for p in problems}

    def script(context: list[int], row: int, seed: int) -> str:
        text = tok.decode(context, skip_special_tokens=True)
        question = text.split("user\n")[1].split("\n")[0]
        return turns[question][1 if "\ntool\n" in text else 0]

    prompts = [task.encode_prompt(tok, p.prompt, system=system) for p in problems]
    episodes = run_episodes(ScriptedBackend(tok, script), prompts, None, tok, SamplingParams(72, n=2), task.limits,
                            seed=3, tools=task.tools)
    renderer = ToolResponseRenderer(tok)
    for episode in episodes:
        problem = problems[episode.prompt_index]
        prompt, ids, mask = reference_episode(task, tok, renderer, problem, pattern, system=system)
        assert (episode.prompt_ids, episode.ids, episode.model_mask) == (prompt, ids, mask)
        assert episode.end_reason == "answer" and task.score(episode.final_text, problem) == 1.0
        assert task.label_strategy(transcript(tok, episode)) == pattern
        assert (0 in mask) == (pattern == "calculator")  # the tool's response, masked


def test_padded_examples_mask_the_prompt_and_the_tool_response(task):
    tok = build_char_tokenizer()
    problem = make_problem("mul", 457, 38)
    rows = [reference_episode(task, tok, ToolResponseRenderer(tok), problem, p) for p in ("calculator", "direct")]
    ids, attention, labels = pad_episodes(rows, tok.pad_token_id)
    prompt, response, mask = rows[0]
    assert ids[0, : len(prompt) + len(response)].tolist() == prompt + response
    trained = labels[0, len(prompt):len(prompt) + len(response)].tolist()
    assert trained == [t if m else -100 for t, m in zip(response, mask, strict=True)]
    assert (labels[0, : len(prompt)] == -100).all() and (labels[1, len(rows[1][0]) + len(rows[1][1]):] == -100).all()
    tool_text = tok.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert tool_text == "\n<s>tool\n17366</s>\n<s>assistant\n"
    assert int(attention[1].sum()) == len(rows[1][0]) + len(rows[1][1])


def test_warm_start_data_uses_both_patterns_on_both_types():
    tok = build_char_tokenizer()
    settings = tools_warm_settings(seed=0, steps=1, preset="tiny", batch_size=200, lr=1e-3, coach_fraction=0.1,
                                   tool_share=0.5)
    examples = EpisodeExamples(tok, settings)
    seen = set()
    for prompt, _ids, mask in examples.rows(200, coached=False):
        question = tok.decode(prompt).split("user\n")[1].split("<")[0]
        seen.add(("*" in question, 0 in mask))
    assert seen == {(False, False), (False, True), (True, False), (True, True)}
    batches = EpisodeExamples(tok, settings).next(0)  # a fresh stream: the same seed, the same batches
    assert len(batches) == 2 and batches[0][0].shape[0] == 200 and batches[1][0].shape[0] == 20
    again = EpisodeExamples(tok, settings).next(0)
    assert all(torch.equal(a, b) for x, y in zip(batches, again, strict=True) for a, b in zip(x, y, strict=True))
