"""meshrl.analysis and its commands: MEI calibration, strategy census, strategy accessibility probe."""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics

import pytest
import torch

from meshrl.analysis import calibrate_mei, census, expand_param_names, probe
from meshrl.analysis._common import forward_response
from meshrl.analysis.census import RolloutRow, tokenize_rollout
from meshrl.cli import census_cmd, mei_cmd, probe_cmd
from meshrl.mesh import RuleCoach, generate_prefixes
from meshrl.models import encode_prompt, load_model
from meshrl.tasks import load_task
from meshrl.trainer.batch import collate


def _cli(module, argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    module.add_parser(sub)
    args = p.parse_args(argv)
    return args.func(args)


# ----------------------------------------------------------------------------------------------- calibrate


def test_calibrate_cli_writes_threshold_json(tmp_path):
    out = tmp_path / "cal" / "threshold.json"
    rc = _cli(mei_cmd, ["mei", "calibrate", "--model", "tiny", "--task", "tiny:add", "--n-queries", "3",
                        "--group-size", "4", "--feature", "bias", "--max-new-tokens", "4", "--temperature", "1.0",
                        "--seed", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["n"] == 3 and data["n_queries"] == 3 and len(data["per_query"]) == 3
    meis = [q["mei"] for q in data["per_query"]]
    assert all(0.0 <= m <= 4.0 for m in meis)
    assert data["mean"] == pytest.approx(statistics.mean(meis))
    assert data["std"] == pytest.approx(statistics.stdev(meis))
    assert data["threshold"] == pytest.approx(data["mean"] + 3 * data["std"])
    for key, want in (("group_size", 4), ("feature", "bias"), ("temperature", 1.0), ("model", "tiny"),
                      ("task", "tiny:add"), ("max_new_tokens", 4), ("seed", 1)):
        assert data[key] == want
    from meshrl.trainer.mei_monitor import load_threshold

    assert load_threshold(str(out), "bias", 4) == pytest.approx(data["threshold"])


def test_calibrate_head_feature_and_temperature():
    r = calibrate_mei("tiny", "tiny:repeat", n_queries=2, group_size=3, feature="head", max_new_tokens=3,
                      temperature=0.7, progress=False, device="cpu")
    assert r["feature"] == "head" and r["temperature"] == 0.7 and r["n"] == 2
    assert all(0.0 <= q["mei"] <= 3.0 for q in r["per_query"])
    assert r["threshold"] == pytest.approx(r["mean"] + 3 * r["std"])


def test_forward_hidden_states_are_the_unembedding_input():
    model, tok = load_model("tiny")
    mb = collate([encode_prompt(tok, "1+2="), encode_prompt(tok, "Repeat: 7")], [[10, 11, 12], [13]],
                 tok.pad_token_id)
    with torch.no_grad():
        logits, h = forward_response(model, mb, hidden=True)
        plain, none = forward_response(model, mb)
    assert none is None and torch.allclose(logits, plain, atol=1e-5)
    assert torch.allclose(h @ model.get_output_embeddings().weight.T, logits, atol=1e-4)


@pytest.mark.parametrize("kw, word", [({"n_queries": 1}, "n_queries"), ({"group_size": 1}, "group_size"),
                                      ({"feature": "full"}, "feature"), ({"temperature": 0.0}, "temperature"),
                                      ({"n_queries": 10_000}, "n_queries")])
def test_calibrate_rejects_bad_settings(kw, word):
    args = {"n_queries": 2, "group_size": 2, **kw}
    with pytest.raises(ValueError, match=word):
        calibrate_mei("tiny", "tiny:add", progress=False, **args)


# ------------------------------------------------------------------------------------------------- census


def _samples(path):
    rows = [{"step": 3, "problem_id": "same", "prompt": "3+4=", "completion": "7 is it", "truncated": False}] * 4
    rows += [{"step": 3, "problem_id": "mixed", "prompt": "2+2=", "completion": c, "truncated": t}
             for c, t in (("4", False), ("zz qq", True), ("4 because 2+2", False), ("~}|{", True))]
    rows += [
        {"step": 3, "prompt": "2+2=", "completion": "4"},  # line 9: no problem_id
        {"step": 3, "problem_id": "mixed", "prompt": "2+2="},  # line 10: no completion
        {"step": 3, "problem_id": "mixed", "prompt": "2+2=", "completion": 4},  # line 12 (11 is blank): not a str
        {"step": 4, "problem_id": "alone", "prompt": "1+1=", "completion": "2"},  # line 13: a group of one
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]) + "\n" +
                    "".join(json.dumps(r) + "\n" for r in rows[10:]))  # a blank line keeps file line numbers
    return path


@pytest.fixture(scope="module")
def census_result(tmp_path_factory):
    path = _samples(tmp_path_factory.mktemp("census") / "samples.jsonl")
    return path, census("tiny", path, progress=False, device="cpu")


def test_census_counts_strategies_and_skips(census_result, caplog):
    path, r = census_result
    groups = {g["key"]["problem_id"]: g for g in r["groups"]}
    assert set(groups) == {"same", "mixed"}
    same = groups["same"]
    assert same["n_rollouts"] == 4 and same["n_strategies"] == 1 and same["labels"] == [0, 0, 0, 0]
    assert same["count_mass"] == [1.0] and same["prob_mass"] == pytest.approx([1.0])
    assert same["max_count_mass"] == 1.0 and same["key"] == {"step": 3, "problem_id": "same"}
    mixed = groups["mixed"]
    assert 2 <= mixed["n_strategies"] <= 4
    assert sum(mixed["count_mass"]) == pytest.approx(1.0) and sum(mixed["prob_mass"]) == pytest.approx(1.0)
    assert r["rows_read"] == 12 and r["rows_skipped"] == 3
    assert [(s["line"], s["reason"]) for s in r["skipped"]] == [
        (9, "missing field 'problem_id'"), (10, "missing field 'completion'"),
        (12, "field 'completion' must be a string, got int")]
    assert r["groups_skipped_small"] == 1 and r["rollouts_in_small_groups"] == 1
    assert r["total"]["n_groups"] == 2 and r["total"]["strategies_total"] == 1 + mixed["n_strategies"]
    assert r["by_step"][0]["step"] == 3 and r["n_params"] == sum(p.numel() for p in load_model("tiny")[0].parameters())


def test_census_logs_skipped_rows_with_line_numbers(tmp_path, caplog):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"problem_id": "a", "prompt": "x"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        r = census("tiny", path, progress=False, device="cpu")
    assert r["rows_skipped"] == 1 and r["groups"] == []
    assert f"{path}:1: skipped: missing field 'completion'" in caplog.text


def test_census_cli_json_parses(tmp_path, capsys):
    path = _samples(tmp_path / "samples.jsonl")
    rc = _cli(census_cmd, ["census", "--model", "tiny", "--rollouts", str(path), "--eps", "0.05",
                           "--params", "model.layers.1.*,lm_head.weight", "--json", "--no-progress",
                           "--device", "cpu"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"]["n_groups"] == 2 and data["rows_skipped"] == 3
    assert "model.embed_tokens.weight" in data["params"]  # lm_head is tied to the embedding
    same = next(g for g in data["groups"] if g["key"]["problem_id"] == "same")
    assert same["n_strategies"] == 1


def test_census_cli_table_with_sketch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = _samples(tmp_path / "samples.jsonl")
    _cli(census_cmd, ["census", "--model", "tiny", "--rollouts", str(path), "--sketch-dim", "256",
                      "--params", "model.layers.0.mlp.*", "--no-progress", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "strategy census" in out and "same" in out and "rows skipped (malformed): 3" in out
    assert "sketched to 256" in out


def test_census_retokenises_with_eos_only_when_not_truncated():
    model, tok = load_model("tiny")
    row = RolloutRow(1, "1+1=", "2", (None, "a"), False, None)
    prompt, resp = tokenize_rollout(tok, row, tok.eos_token_id)
    assert prompt == encode_prompt(tok, "1+1=")
    assert resp == tok.encode("2", add_special_tokens=False) + [tok.eos_token_id]
    for trunc in (True, None):
        row.truncated = trunc
        assert tokenize_rollout(tok, row, tok.eos_token_id)[1] == tok.encode("2", add_special_tokens=False)


def test_census_bad_input_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem_id": "a", "prompt": "x", "completion": "y"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: not valid JSON"):
        census("tiny", bad, progress=False)
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 1: expected a JSON object"):
        census("tiny", bad, progress=False)
    with pytest.raises(ValueError, match="missing.jsonl: no such file"):
        census("tiny", tmp_path / "missing.jsonl", progress=False)
    with pytest.raises(ValueError, match="eps"):
        census("tiny", bad, eps=-1.0, progress=False)


def test_expand_param_names_globs_and_tied_aliases():
    model, _ = load_model("tiny")
    names = expand_param_names(model, "model.layers.0.mlp.*,lm_head.weight")
    assert names == ["model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                     "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    assert expand_param_names(model, None) is None
    with pytest.raises(ValueError, match="'nope.*' matches no parameter"):
        expand_param_names(model, ["nope.*"])


# -------------------------------------------------------------------------------------------------- probe


@pytest.fixture(scope="module")
def prefixes_file(tmp_path_factory):
    task = load_task("tiny:add")
    problems = task.problems("train")[:3]  # the 4th problem of the split has no prefixes
    by_id = {p.id: p for p in problems}
    queries = [{"id": p.id, "problem": p.prompt, "answer": p.answer} for p in problems]
    out = tmp_path_factory.mktemp("probe") / "prefixes.jsonl"
    generate_prefixes(queries, RuleCoach(lambda q: task.coach_strategies(by_id[q["id"]])), m=4, out_path=out)
    return out


def test_probe_reports_every_strategy(prefixes_file):
    r = probe("tiny", "tiny:add", prefixes_file, n=2, limit=4, max_new_tokens=3, progress=False, device="cpu")
    assert r["m"] == 4 and len(r["strategies"]) == 4
    assert r["problems_used"] == 3 and r["problems_skipped_no_prefix"] == 1 and r["problems_total"] == 4
    for s in r["strategies"]:
        assert s["n_problems"] == 3 and 0.0 <= s["accuracy"] <= 1.0 and 0.0 <= s["solved_frac"] <= 1.0
        assert math.isfinite(s["logp_sum_mean"]) and s["logp_sum_mean"] < 0
        assert math.isfinite(s["logp_per_token_mean"]) and s["prefix_tokens_mean"] > 0
    assert 0.0 <= r["baseline"]["accuracy"] <= 1.0
    # log p(prefix | unconditioned prompt) by hand: one forward over prompt + prefix tokens, no padding
    model, tok = load_model("tiny")
    task = load_task("tiny:add")
    problem = task.problems("train")[0]
    prefix = task.coach_strategies(problem)[1]
    prompt = encode_prompt(tok, task.format_prompt(problem))
    ids = prompt + tok.encode(prefix, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    want = float(logp[torch.arange(len(prompt) - 1, len(ids) - 1), torch.tensor(ids[len(prompt):])].sum())
    got = r["per_problem"][0]
    assert got["problem_id"] == problem.id and got["logp_sum"][1] == pytest.approx(want, rel=1e-4)
    assert got["logp_per_token"][1] == pytest.approx(want / (len(ids) - len(prompt)), rel=1e-4)


def test_probe_cli_json_and_table(prefixes_file, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps table cells to the terminal width
    argv = ["probe", "--model", "tiny", "--prefixes", str(prefixes_file), "--task", "tiny:add", "--n", "1",
            "--limit", "2", "--max-new-tokens", "2", "--no-progress", "--device", "cpu"]
    assert _cli(probe_cmd, [*argv, "--json", "--no-baseline"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["strategies"]) == 4 and data["baseline"] is None and data["problems_used"] == 2
    _cli(probe_cmd, argv)
    out = capsys.readouterr().out
    assert "strategy probe" in out and "none" in out and "Count on from the larger" in out


def test_probe_bad_input_names_the_file(tmp_path, prefixes_file):
    with pytest.raises(ValueError, match="nothere.jsonl: no such file"):
        probe("tiny", "tiny:add", tmp_path / "nothere.jsonl", n=1, progress=False)
    with pytest.raises(ValueError, match="none of the .* problems"):
        probe("tiny", "tiny:repeat", prefixes_file, n=1, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "k", "prefixes": ["a"]}\n{oops\n{"key": "j"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        probe("tiny", "tiny:add", bad, n=1, progress=False)
    with pytest.raises(ValueError, match="n must be"):
        probe("tiny", "tiny:add", prefixes_file, n=0, progress=False)
