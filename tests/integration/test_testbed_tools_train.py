"""``testbed:tools`` end to end: a (tiny, briefly) warm-started model trains two GRPO steps on episodes with the
calculator, and the step records carry the tool metrics and the tool-pattern strategy masses."""

from __future__ import annotations

import meshrl.testbed  # noqa: F401  (registers testbed:tools)
from meshrl.jsonl import read_jsonl
from meshrl.testbed.tools_measure import tool_report
from meshrl.testbed.tools_task import MAX_TURN_TOKENS
from meshrl.testbed.tools_warm import tools_warm_start
from meshrl.testbed.warm import warm_info
from meshrl.trainer import load_config, train


def test_two_steps_on_testbed_tools(tmp_path):
    model = tools_warm_start(tmp_path / "warm", steps=3, preset="tiny", batch_size=8, threads=1, progress=False)
    assert warm_info(model)["settings"]["steps"] == 3
    assert tools_warm_start(tmp_path / "warm", steps=3, preset="tiny", batch_size=8, progress=False) == model  # cached
    cfg = load_config(overrides=[
        f"model={model}", "task=testbed:tools", "steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
        f"rollout.max_new_tokens={MAX_TURN_TOKENS}", "train.micro_batch_size=8", "log.progress=false",
        "checkpoint.every=2", "train.update_workers=1", "rollout.decode_workers=1", "recipe=grpo", "seed=0"])
    train(cfg, tmp_path / "run")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("turns/mean", "tools/calls_mean", "tools/parse_fail_frac", "strategy/max_mass"):
        assert key in rows[-1], key
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()

    from meshrl.tasks import load_task
    from meshrl.trainer import load_policy

    task = load_task("testbed:tools", size=4, eval_size=4)
    model_, tok, _ = load_policy(str(tmp_path / "run" / "checkpoints" / "step_000002"))
    report = tool_report(model_, tok, task, task.problems("eval"), n=2, seed=0)
    assert report["all"]["n"] == 8 and report["add"]["n"] + report["mul"]["n"] == 8


def test_a_continued_warm_start_records_its_lineage(tmp_path):
    import pytest
    from safetensors.torch import load_file

    first = tools_warm_start(tmp_path / "a", steps=2, preset="tiny", batch_size=4, threads=1, progress=False)
    second = tools_warm_start(tmp_path / "b", steps=1, preset="tiny", batch_size=4, lr=1e-3, threads=1,
                              progress=False, init=first)
    lineage = warm_info(second)["settings"]["init"]
    assert lineage["path"] == str(first) and lineage["steps"] == 2 and "init" not in lineage
    a, b = (load_file(str(d / "model.safetensors")) for d in (first, second))
    assert any(not (a[k] == b[k]).all() for k in a)  # trained on from the first stage's weights
    with pytest.raises(ValueError, match="is not a warm start directory"):
        tools_warm_start(tmp_path / "c", steps=1, preset="tiny", init=tmp_path / "nowhere", progress=False)
