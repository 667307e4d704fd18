"""StepData's typed rows: a Sample appended, read back, replaced and selected, optional columns by their defaults."""

from __future__ import annotations

import dataclasses

import torch

from meshrl.trainer.step_data import ROW_COLUMNS, Sample, StepData


def _sample(i: int, **kw) -> Sample:
    return Sample(prompt_ids=[1, i], response_ids=[i] * (i + 1), text=f"t{i}", truncated=False, problem=f"p{i}",
                  group_id=i // 2, query_id=i // 2, strategy_id=-1, score=float(i), rollout_logps=[-0.5] * (i + 1),
                  **kw)


def test_rows_round_trip_and_every_field_has_a_column():
    assert set(ROW_COLUMNS) == {f.name for f in dataclasses.fields(Sample)}
    data = StepData()
    for i in range(3):
        data.append(_sample(i))
    assert len(data) == 3 and data.texts == ["t0", "t1", "t2"] and data.row(2) == _sample(2)
    assert data.response_masks == [] and data.label_texts == []  # single-turn rows: the episode columns stay empty
    assert data.origin == ["", "", ""] and data.rollout_features == [None, None, None]


def test_replace_row_fills_a_short_optional_column_and_select_keeps_rewards():
    data = StepData()
    for i in range(4):
        data.append(_sample(i))
    data.origin, data.unsampled = [], []  # a batch built before provenance existed
    data.replace_row(2, dataclasses.replace(data.row(2), origin="luffy", unsampled=3, text="trace"))
    assert data.origin == ["", "", "luffy", ""] and data.unsampled == [0, 0, 3, 0] and data.texts[2] == "trace"
    assert data.rows_from("luffy") == {2} and data.row(3).origin == ""
    data.rewards, data.advantages = torch.arange(4.0), torch.arange(4.0) * 10
    data.stats = {"x": 1.0}
    sub = data.select([3, 1])
    assert sub.texts == ["t3", "t1"] and torch.equal(sub.advantages, torch.tensor([30.0, 10.0]))
    assert sub.stats == {"x": 1.0} and sub.origin == ["", ""]


def test_episode_rows_carry_their_masks_and_labels():
    data = StepData()
    data.append(_sample(0, response_mask=[1], label_text="call"))
    data.append(_sample(1, response_mask=[1, 0], label_text="call again"))
    assert data.response_masks == [[1], [1, 0]] and data.label_texts == ["call", "call again"]
    assert data.model_mask(1) == [1, 0]
