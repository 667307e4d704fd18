"""The bad-input corpus: every case gets a clear error naming the file/line/field/setting, a counted skip, or
is accepted as valid input with a stated meaning. Never a traceback from deep inside a run.

Each case list below carries its verdict; ``CORPUS`` counts them, and docs/reliability.md ("Bad input")
states the same counts (checked by the last test).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from meshrl.cli import main as cli_main
from meshrl.evaluation import EvalConfig, run_eval
from meshrl.jsonl import read_jsonl
from meshrl.tasks import load_task
from meshrl.trainer import load_config, train

# --- config: --set KEY=VALUE -------------------------------------------------------------------------------
# (override, a regex the error must contain: the key, and where it helps the offending value)
SET_ERRORS = [
    ("rollout.group_size=2.5", r"rollout\.group_size must be an integer, got 2\.5"),
    ("rollout.group_size=abc", r"rollout\.group_size must be an integer"),
    ("rollout.group_size=true", r"rollout\.group_size must be an integer, got True"),
    ("rollout.group_size=0", r"rollout\.group_size=0 .*>= 1"),
    ("rollout.group_size=[4]", r"rollout\.group_size must be an integer"),
    ("rollout.prompts_per_step=-1", r"rollout\.prompts_per_step=-1"),
    ("rollout.max_new_tokens=0", r"rollout\.max_new_tokens=0"),
    ("rollout.temperature=-0.5", r"rollout\.temperature=-0\.5"),
    ("rollout.top_p=1.5", r"rollout\.top_p=1\.5 .*\(0, 1\]"),
    ("rollout.batch_size=0", r"rollout\.batch_size=0"),
    ("rollout.backend=torch", r"rollout\.backend='torch'; known: auto, hf, native, vllm"),
    ("optim.lr.x=1", r"optim\.lr is a value .*not a section"),
    ("optim.lr=fast", r"optim\.lr must be a finite number, got 'fast'"),
    ("optim.lr=.nan", r"optim\.lr must be a finite number, got nan"),
    ("optim.lr=.inf", r"optim\.lr must be a finite number, got inf"),
    ("optim.lr=-1e-5", r"optim\.lr=-1e-05"),
    ("optim.lr=[1", r"--set optim\.lr: cannot parse the value '\[1' as YAML"),
    ("optim.lr={a: 1", r"--set optim\.lr: cannot parse the value"),
    ("optim=3", r"config key optim is a section"),
    ("optim.beta2=1", r"optim\.beta2=1\.0 .*\[0, 1\)"),
    ("optim.eps=0", r"optim\.eps=0\.0"),
    ("optim.max_grad_norm=0", r"optim\.max_grad_norm=0\.0"),
    ("optim.weight_decay=-0.1", r"optim\.weight_decay=-0\.1"),
    ("optim.warmup_steps=-2", r"optim\.warmup_steps=-2"),
    ("optim.schedule=step", r"optim\.schedule='step'; known: constant, linear, cosine"),
    ("optim.min_lr_ratio=2", r"optim\.min_lr_ratio=2\.0"),
    ("optim.lrr=1", r"unknown config key\(s\) \['optim\.lrr'\]"),
    ("train.dtype=fp8", r"train\.dtype='fp8'"),
    ("train.micro_batch_size=0.5", r"train\.micro_batch_size must be an integer"),
    ("train.ppo_epochs=0", r"train\.ppo_epochs=0"),
    ("train.lora_r=-8", r"train\.lora_r=-8"),
    ("train.autocast_bf16=yes please", r"train\.autocast_bf16 must be true/false"),
    ("reward.strict=maybe", r"reward\.strict must be true/false"),
    ("reward.timeout_s=0", r"reward\.timeout_s=0\.0"),
    ("checkpoint.every=0", r"checkpoint\.every=0"),
    ("checkpoint.keep_last=0", r"checkpoint\.keep_last=0"),
    ("log.samples_per_step=-2", r"log\.samples_per_step=-2"),
    ("log.report_to=[mlflow]", r"unknown --report-to target 'mlflow' \(log\.report_to\)"),
    ("log.report_to=3", r"log\.report_to must be a list"),
    ("failure.max_nonfinite=0", r"failure\.max_nonfinite=0"),
    ("eval.n=0", r"eval\.n=0"),
    ("eval.limit=-1", r"eval\.limit=-1"),
    ("dynamic_sampling.max_rounds=0", r"dynamic_sampling\.max_rounds=0"),
    ("diag.mei.every=-1", r"diag\.mei\.every=-1"),
    ("diag.mei.feature=tail", r"diag\.mei\.feature='tail'"),
    ("mesh.placement=user", r"mesh\.placement='user'"),
    ("algo.clip_high=wide", r"algo\.clip_high must be a finite number or null, got 'wide'"),
    ("algo.dynamic_sampling=2", r"algo\.dynamic_sampling must be true/false"),
    ("algo.clip_hi=0.3", r"unknown config key\(s\) \['algo\.clip_hi'\]"),
    ("recipe=ppo", r"unknown recipe 'ppo'"),
    ("steps=-1", r"steps=-1"),
    ("steps=1e400", r"steps must be an integer"),
    ("seed=0.5", r"seed must be an integer"),
    ("model=3", r"config key model must be a string"),
    ("task_options=3", r"task_options must be a mapping"),
    ("=3", r"the key '' is empty"),
    ("optim..lr=3", r"the key 'optim\.\.lr' is empty or has an empty part"),
    ("optim.lr", r"--set expects key=value"),
]

# Accepted, with the meaning stated: (override, dotted key, value it resolves to)
SET_VALID = [
    ("rollout.group_size=4.0", "rollout.group_size", 4),  # an integral float is the integer
    ("optim.lr='3e-4'", "optim.lr", 3e-4),  # a quoted number (YAML 1.1 reads 1e-5 as text) is the number
    ("optim.lr=1", "optim.lr", 1.0),  # an integer for a float key
    ("log.report_to=tensorboard", "log.report_to", ["tensorboard"]),  # a comma string is a list
    ("diag.mei.threshold=0.5", "diag.mei.threshold", 0.5),  # a number, or a threshold.json path
    ("rollout.temperature=0", "rollout.temperature", 0.0),  # greedy decoding
]


@pytest.mark.parametrize(("override", "needle"), SET_ERRORS, ids=[c[0] for c in SET_ERRORS])
def test_set_errors_name_the_key(override, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(overrides=[override])


@pytest.mark.parametrize(("override", "key", "value"), SET_VALID, ids=[c[0] for c in SET_VALID])
def test_set_values_accepted_as_valid(override, key, value):
    from meshrl.trainer.config import get_key

    got = get_key(load_config(overrides=[override]), key)
    assert got == pytest.approx(value) if isinstance(value, float) else got == value


# --- config files (--config, and config.yaml on resume) ----------------------------------------------------
# (file bytes, regex; "{f}" stands for the file's path)
YAML_ERRORS = [
    (b"optim:\n\tlr: 1\n", r"{f}, line 2, column 1: YAML syntax error: found character '\\t'"),
    (b"optim: {lr: 1\n", r"{f}, line 2, column 1: YAML syntax error"),
    (b"steps: 3\nmodel: a: b\n", r"{f}, line 2, column 9: YAML syntax error: mapping values are not allowed"),
    (b"steps: 3\nsteps: 4\n", r"{f}, line 2, column 1: .*key 'steps' repeats \(first at line 1\)"),
    (b"optim:\n  lr: 1\n  lr: 2\n", r"{f}, line 3, column 3: .*key 'lr' repeats"),
    ("model: caf\xe9\n".encode("latin-1"), r"{f}, line 1: not UTF-8 text \(byte 0xe9\)"),
    (b"steps: 1\nmodel: \xff\xfe\n", r"{f}, line 2: not UTF-8 text"),
    (b"- 1\n- 2\n", r"{f} must hold a mapping at the top level, got list"),
    (b"hello\n", r"{f} must hold a mapping at the top level, got str"),
    (b"optim: 3\n", r"config file {f}: config key optim is a section"),
    (b"optimizer:\n  lr: 1\n", r"config file {f}: unknown config key\(s\) \['optimizer'\]"),
    (b"rollout:\n  group_size: 2.5\n", r"config file {f}: config key rollout\.group_size must be an integer"),
    (b"optim:\n  lr:\n    x: 1\n", r"config file {f}: config key optim\.lr is a value"),
]
YAML_VALID = [
    (b"", "steps", 20),  # an empty file is the defaults
    (b"# only a comment\n", "steps", 20),
    ("\ufeffsteps: 3\n".encode(), "steps", 3),  # a byte-order mark is dropped
    (b"optim:\n  # lr: 1\nsteps: 2\n", "optim.lr", 1e-5),  # a section with every key commented out
    (b"steps: '5'\n", "steps", 5),
]


@pytest.mark.parametrize(("content", "needle"), YAML_ERRORS, ids=[f"yaml{i}" for i in range(len(YAML_ERRORS))])
def test_config_file_errors_name_the_file_and_line(tmp_path, content, needle):
    f = tmp_path / "run.yaml"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=needle.format(f=re.escape(str(f)))) as err:
        load_config(f)
    assert not isinstance(err.value, UnicodeDecodeError)


@pytest.mark.parametrize(("content", "key", "value"), YAML_VALID, ids=[f"yaml_ok{i}" for i in range(len(YAML_VALID))])
def test_config_files_accepted_as_valid(tmp_path, content, key, value):
    from meshrl.trainer.config import get_key

    f = tmp_path / "run.yaml"
    f.write_bytes(content)
    assert get_key(load_config(f), key) == pytest.approx(value)


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ValueError, match=rf"config file not found: {re.escape(str(tmp_path))} \(it is a directory\)"):
        load_config(tmp_path)


# --- task specs --------------------------------------------------------------------------------------------
SPEC_ERRORS = [
    ("nope", r"unknown task spec 'nope'; known forms"),
    ("jsonl:", r"missing its argument; expected the form jsonl:PATH"),
    ("jsonl:{d}/absent.jsonl", r"task file not found: .*absent\.jsonl"),
    ("jsonl:{d}", r"task file not found"),  # a directory
    ("jsonl:{f}?kind=fuzzy", r"kind must be one of .*'fuzzy'"),
    ("jsonl:{f}?problm=q", r"unknown option\(s\) \['problm'\]"),
    ("jsonl:{f}?limit=0", r"limit must be a positive integer, got 0"),
    ("jsonl:{f}?limit=abc", r"limit must be a positive integer, got 'abc'"),
    ("jsonl:{f}?eval_fraction=1.5", r"eval_fraction must be in \[0, 1\), got 1\.5"),
    ("jsonl:{f}?eval_fraction=most", r"option eval_fraction must be a finite number, got 'most'"),
    ("jsonl:{f}?seed=abc", r"option seed must be an integer, got 'abc'"),
    ("jsonl:{f}?limit", r"option 'limit' is not of the form key=value"),
    ("jsonl:{f}?answer=solution", r"missing field 'solution'"),
    ("jsonl:{f}?instruction=[1, 2]", r"instruction must be text"),
    ("tiny:add?max_operand=abc", r"task 'tiny:add': option max_operand must be an integer, got 'abc'"),
    ("tiny:add?max_operand=0", r"max_operand must be in \[1, 99\], got 0"),
    ("tiny:repeat?size=x", r"task 'tiny:repeat': option size must be an integer"),
    ("tiny:add?seed=1.5", r"option seed must be an integer, got 1\.5"),
    ("aime:{f}", r"field 'answer' must be an integer from 0 to 999"),  # the file's answer "three"
    ("mcq:{f}", r"missing field 'question'"),
    ("gpqa:{f}", r"missing field 'Question'"),
    ("humaneval:{d}/absent.jsonl", r"task file not found"),
]


@pytest.mark.parametrize("spec, needle", SPEC_ERRORS, ids=[c[0] for c in SPEC_ERRORS])
def test_task_spec_errors_name_the_option(tmp_path, spec, needle):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"id": "a", "problem": "What is 1+2?", "answer": "three"}) + "\n")
    with pytest.raises(ValueError, match=needle):
        load_task(spec.format(f=f, d=tmp_path))


# --- data files --------------------------------------------------------------------------------------------
def _row(**fields) -> bytes:
    return (json.dumps({"problem": "What is 1+2?", "answer": "3", **fields}) + "\n").encode()


GOOD = _row(id="g1")
# (file name, bytes, spec options, regex; "{f}" is the file's path)
DATA_ERRORS = [
    ("t.jsonl", GOOD + b'{"problem": "caf\xe9", "answer": "3"}\n', "", r"{f}, line 2: not UTF-8 text \(byte 0xe9"),
    ("t.jsonl", b"\xff\xfe" + GOOD, "", r"{f}, line 1: not UTF-8 text"),  # UTF-16 byte-order mark
    ("t.jsonl", GOOD + b'{"problem": "x", "answer": \n', "", r"{f}, line 2: malformed JSON"),
    ("t.jsonl", GOOD + b"[1, 2]\n", "", r"{f}, line 2: expected a JSON object, got list"),
    ("t.jsonl", GOOD + b'{"problem": "x"}\n', "", r"{f}, line 2: missing field 'answer'"),
    ("t.jsonl", GOOD + b'{"problem": "x", "answer": null}\n', "", r"{f}, line 2: field 'answer' is missing \(null\)"),
    ("t.jsonl", GOOD + b'{"problem": "  ", "answer": "1"}\n', "", r"{f}, line 2: field 'problem' is empty"),
    ("t.jsonl", GOOD + b'{"problem": "x", "answer": ""}\n', "", r"{f}, line 2: field 'answer' is empty"),
    ("t.jsonl", GOOD + b'{"problem": "x", "answer": NaN}\n', "", r"{f}, line 2: field 'answer' is nan, not a finite"),
    ("t.jsonl", GOOD + b'{"problem": "x", "answer": Infinity}\n', "", r"{f}, line 2: field 'answer' is inf"),
    ("t.jsonl", GOOD + b'{"problem": NaN, "answer": "1"}\n', "", r"{f}, line 2: field 'problem' is nan"),
    ("t.jsonl", GOOD + _row(answer="NaN"), "?kind=number", r"{f}, line 2: field 'answer' is not a finite number"),
    ("t.jsonl", GOOD + _row(answer="inf"), "?kind=number", r"{f}, line 2: field 'answer' is not a finite number"),
    ("t.jsonl", GOOD + _row(answer="-Infinity"), "?kind=last_number", r"{f}, line 2: field 'answer' is not a finite"),
    ("t.jsonl", GOOD + _row(answer="three"), "?kind=number", r"{f}, line 2: field 'answer' is not a finite number"),
    ("t.jsonl", _row(answer="7"), "?kind=choice", r"{f}, line 1: field 'answer' is not a choice letter A-J"),
    ("t.jsonl", GOOD + _row(answer=True), "", r"{f}, line 2: field 'answer' must be a string, got bool"),
    ("t.jsonl", GOOD + _row(answer=[3]), "", r"{f}, line 2: field 'answer' must be a string, got list"),
    ("t.jsonl", GOOD + _row(id="g1"), "", r"{f}, line 2: field 'id' repeats id 'g1' \(first seen at line 1\)"),
    ("t.jsonl", GOOD + _row(id={"a": 1}), "", r"{f}, line 2: field 'id' must be a string, got dict"),
    ("t.jsonl", b"", "", r"{f}: no problems \(the file has no rows\)"),
    ("t.jsonl", b"\n  \n\n", "", r"{f}: no problems"),
    ("t.jsonl", GOOD + b"[" * 100_000 + b"\n", "", r"{f}, line 2: (JSON nested too deeply|malformed JSON)"),
    ("t.parquet", b"PAR1 not really parquet", "", r"{f}: cannot read Parquet file"),
]
# Files read through the benchmark formats (aime:, mcq:, ...): (file name, bytes, spec prefix, regex)
FORMAT_ERRORS = [
    ("a.jsonl.gz", b"not gzip at all", "aime", r"{f}: not a readable gzip file"),
    ("a.jsonl.gz", gzip.compress(GOOD)[:-12], "aime", r"{f}: not a readable gzip file"),  # truncated
    ("a.jsonl", GOOD + b'{"problem": "caf\xe9", "answer": 3}\n', "aime", r"{f}, line 2: not UTF-8 text"),
    ("a.jsonl", GOOD + _row(answer="1000"), "aime", r"{f}, line 2: field 'answer' must be an integer from 0 to 999"),
    ("a.jsonl", GOOD + _row(answer=float("nan")), "aime", r"{f}, line 2: field 'answer' must be an integer"),
    ("m.csv", b"question,choices,answer\nQ?,\"[\"\"a\"\",\"\"b\"\"]\",a\nR?,\"[\"\"c\xe9\"\"]\",c\n", "mcq",
     r"{f}, line 3: not UTF-8 text"),
    ("m.csv", b'question,choices,answer\nQ?,"[""a"",""a""]",a\n', "mcq", r"{f}, line 2: field 'choices': duplicate"),
    ("m.csv", b'question,choices,answer\nQ?,"[""a"",""b""]",z\n', "mcq", r"{f}, line 2: field 'answer'.*not among"),
    ("m.txt", b"anything", "mcq", r"{f}: unsupported file type"),
]
# Accepted as valid: (bytes, spec options, check on the loaded task)
DATA_VALID = [
    ("\ufeff".encode() + GOOD, "", lambda t: t.problems("all")[0].id == "g1"),  # UTF-8 byte-order mark dropped
    (_row(answer=3), "?kind=number", lambda t: t.problems("all")[0].answer == "3"),  # a number becomes text
    (_row(id=None) + _row(id=None), "", lambda t: [p.id for p in t.problems("all")] == ["0", "1"]),  # row index
    (b"\n" + GOOD + b"\n\n", "", lambda t: len(t.problems("all")) == 1),  # blank lines skipped
    (_row(answer="1,234"), "?kind=last_number", lambda t: t.instruction.startswith("End your reply")),
]


@pytest.mark.parametrize(("name", "content", "options", "needle"), DATA_ERRORS,
                         ids=[f"data{i}" for i in range(len(DATA_ERRORS))])
def test_data_file_errors_name_the_file_line_and_field(tmp_path, name, content, options, needle):
    f = tmp_path / name
    f.write_bytes(content)
    fmt = "parquet" if name.endswith(".parquet") else "jsonl"
    with pytest.raises(ValueError, match=needle.format(f=re.escape(str(f)))) as err:
        load_task(f"{fmt}:{f}{options}")
    assert not isinstance(err.value, UnicodeDecodeError)


@pytest.mark.parametrize(("name", "content", "prefix", "needle"), FORMAT_ERRORS,
                         ids=[f"format{i}" for i in range(len(FORMAT_ERRORS))])
def test_benchmark_file_errors_name_the_file_and_line(tmp_path, name, content, prefix, needle):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(ValueError, match=needle.format(f=re.escape(str(f)))) as err:
        load_task(f"{prefix}:{f}")
    assert not isinstance(err.value, UnicodeDecodeError)


@pytest.mark.parametrize(("content", "options", "check"), DATA_VALID,
                         ids=[f"data_ok{i}" for i in range(len(DATA_VALID))])
def test_data_files_accepted_as_valid(tmp_path, content, options, check):
    f = tmp_path / "t.jsonl"
    f.write_bytes(content)
    assert check(load_task(f"jsonl:{f}{options}"))


# --- prompts longer than the model's context ---------------------------------------------------------------
FAST = ["model=tiny", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "log.progress=false", "train.update_workers=1", "checkpoint.every=10"]


def _long_file(tmp_path: Path, n_short: int = 6, long: dict[str, int] | None = None) -> Path:
    rows = [{"id": f"p{i}", "problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(n_short)]
    for pid, chars in (long or {}).items():
        rows.append({"id": pid, "problem": "What is 2+3? " * (chars // 13), "answer": "5"})
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_training_skips_and_counts_prompts_too_long_for_the_model(tmp_path, caplog):
    # tiny has 4096 positions: a 10k-character problem (~10k tokens) and a 1M-character one cannot fit.
    f = _long_file(tmp_path, long={"long10k": 10_000, "long1m": 1_000_000})
    cfg = load_config(overrides=[*FAST, f"task=jsonl:{f}?kind=number", "steps=3"])
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        hist = train(cfg, tmp_path / "run")
    # 3 steps x 4 problems that fit take 12 of the 6 short ones: two epochs of 8, each meeting both long ones.
    assert [m["skipped/long_prompts"] for m in hist] == [1.0, 1.0, 2.0]
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 2 and "4096 positions" in warned[0]  # logged once per problem, with its id
    assert {"'long10k' skipped", "'long1m' skipped"} == {w.split(":")[0].replace("problem ", "") for w in warned}
    problems = {r["problem_id"] for r in read_jsonl(tmp_path / "run" / "samples.jsonl")}
    assert not problems & {"long10k", "long1m"}


def test_a_resume_past_skipped_prompts_draws_the_same_problems(tmp_path):
    f = _long_file(tmp_path, long={"long10k": 10_000})
    base = [*FAST, f"task=jsonl:{f}?kind=number", "log.samples_per_step=-1", "checkpoint.every=1"]
    full = train(load_config(overrides=[*base, "steps=3"]), tmp_path / "full")
    train(load_config(overrides=[*base, "steps=1"]), tmp_path / "part")
    resumed = train(load_config(tmp_path / "part" / "config.yaml", ["steps=3"]), tmp_path / "part", resume=True)
    assert [m["skipped/long_prompts"] for m in resumed] == [m["skipped/long_prompts"] for m in full[1:]]
    assert sum(m["skipped/long_prompts"] for m in full) >= 1

    def drawn(run):
        return [(r["step"], r["problem_id"]) for r in read_jsonl(tmp_path / run / "samples.jsonl")]

    assert drawn("part") == drawn("full")


def test_held_out_evaluation_during_training_skips_and_counts_prompts_too_long(tmp_path, caplog):
    # 6 short + 4 long (10k tokens; tiny has 4096 positions); half held out: PeriodicEval encoded every
    # held-out prompt and generated past the model's positions at the first evaluation.
    f = _long_file(tmp_path, n_short=6, long={f"long{i}": 10_000 for i in range(4)})
    spec = f"task=jsonl:{f}?kind=number&eval_fraction=0.5"
    held = {p.id for p in load_task(spec.removeprefix("task="), seed=0).problems("eval")}
    n_long = len({p for p in held if p.startswith("long")})
    assert 0 < n_long < len(held)  # the seeded split holds both kinds
    cfg = load_config(overrides=[*FAST, spec, "steps=1", "eval.every=1", "eval.n=1", "eval.max_new_tokens=3",
                                 "seed=0"])
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        hist = train(cfg, tmp_path / "run")
    assert hist[-1]["eval/skipped_long_prompts"] == n_long
    assert sum("skipped" in r.getMessage() and "eval.max_new_tokens=3" in r.getMessage()
               for r in caplog.records) == n_long


def test_held_out_evaluation_refuses_when_no_held_out_prompt_fits(tmp_path):
    f = _long_file(tmp_path, n_short=1, long={"a": 10_000})
    spec = f"jsonl:{f}?eval_fraction=0.5"
    assert [p.id for p in load_task(spec, seed=1).problems("eval")] == ["a"]  # seed 1 holds out the long one
    cfg = load_config(overrides=[*FAST, f"task={spec}", "steps=1", "eval.every=1", "eval.n=1", "seed=1"])
    with pytest.raises(ValueError, match=r"every held-out prompt is too long for the model \(4096 positions with "
                                         r"rollout\.max_new_tokens=4\)"):
        train(cfg, tmp_path / "run")


def test_training_refuses_when_no_prompt_fits(tmp_path):
    f = _long_file(tmp_path, n_short=0, long={"a": 10_000, "b": 10_000})
    cfg = load_config(overrides=[*FAST, f"task=jsonl:{f}", "steps=1"])
    with pytest.raises(ValueError, match=r"every training problem's prompt is too long for the model \(4096"):
        train(cfg, tmp_path / "run")


def test_max_new_tokens_past_the_model_positions_is_refused(tmp_path):
    cfg = load_config(overrides=[*FAST, "task=tiny:add", "rollout.max_new_tokens=5000", "steps=1"])
    with pytest.raises(ValueError, match=r"rollout\.max_new_tokens=5000 leaves no room for a prompt in the model's "
                                         r"4096 positions"):
        train(cfg, tmp_path / "run")


def test_eval_skips_and_lists_prompts_too_long_for_the_model(tmp_path):
    f = _long_file(tmp_path, n_short=2, long={"long10k": 10_000})
    s = run_eval(EvalConfig(model="tiny", data=f"jsonl:{f}?kind=number", n=1, max_new_tokens=3), tmp_path / "ev",
                 progress=False)
    assert set(s["skipped_long_prompts"]) == {"long10k"} and s["overall"]["problems"] == 2
    assert {r["problem_id"] for r in read_jsonl(tmp_path / "ev" / "eval_samples.jsonl")} == {"p0", "p1"}


def test_eval_measures_a_huge_prompt_from_its_head_only(tmp_path, monkeypatch):
    # docs/reliability.md: a 1M-character problem is measured from its first characters only. meshrl eval
    # encoded it whole (and held-out evaluation during training did too).
    import meshrl.models

    longest: list[int] = []
    real = meshrl.models.encode_prompt

    def spy(tok, text, **kw):
        longest.append(len(text))
        return real(tok, text, **kw)

    monkeypatch.setattr(meshrl.models, "encode_prompt", spy)
    f = _long_file(tmp_path, n_short=1, long={"long1m": 1_000_000})
    s = run_eval(EvalConfig(model="tiny", data=f"jsonl:{f}?kind=number", n=1, max_new_tokens=3), tmp_path / "ev",
                 progress=False)
    assert set(s["skipped_long_prompts"]) == {"long1m"}
    assert max(longest) <= 16 * 4096  # PROBE_CHARS_PER_POSITION x the tiny model's positions


def test_eval_refuses_when_no_prompt_fits(tmp_path):
    f = _long_file(tmp_path, n_short=0, long={"a": 10_000})
    with pytest.raises(ValueError, match=r"every problem's prompt is too long for the model"):
        run_eval(EvalConfig(model="tiny", data=f"jsonl:{f}", n=1, max_new_tokens=3), tmp_path / "ev", progress=False)


# --- settings that are checked when a run starts (files they name, the model) -----------------------------
TRAIN_ERRORS = [
    (["recipe=mesh", "rollout.group_size=4", "mesh.prefixes={d}/absent.jsonl"], r"mesh\.prefixes file not found"),
    (["diag.mei.every=1", "diag.mei.threshold={d}/absent.json"], r"diag\.mei\.threshold: .* is neither a number"),
    (["model={d}/no_model"], r"unknown model .*no_model.*or a local Hugging Face directory"),
    (["task=jsonl:{d}/absent.jsonl"], r"task file not found: .*absent\.jsonl"),
    (["task_options={{limit: 3}}"], r"task 'tiny:add': unknown option\(s\) \['limit'\]"),
    (["task=jsonl:{d}/one.jsonl", "eval.every=1"], r"eval\.every=1 needs a held-out split 'eval'"),
]


@pytest.mark.parametrize("overrides", [c[0] for c in TRAIN_ERRORS], ids=[c[0][-1] for c in TRAIN_ERRORS])
def test_run_start_errors_name_the_setting(tmp_path, overrides):
    needle = dict((tuple(c[0]), c[1]) for c in TRAIN_ERRORS)[tuple(overrides)]
    (tmp_path / "one.jsonl").write_text(json.dumps({"problem": "What is 1+2?", "answer": "3"}) + "\n")
    cfg = load_config(overrides=[*FAST, "task=tiny:add", "steps=1", *[o.format(d=tmp_path) for o in overrides]])
    with pytest.raises(ValueError, match=needle):
        train(cfg, tmp_path / "run")


# --- eval options ------------------------------------------------------------------------------------------
EVAL_ERRORS = [
    ({"n": 0}, r"--n must be >= 1, got 0"),
    ({"ks": [4]}, r"--k values \[4\] must be between 1 and --n 2"),
    ({"ks": []}, r"--k needs at least one value"),
    ({"limit": 0}, r"--limit must be >= 1, got 0"),
    ({"limit": -1}, r"--limit must be >= 1, got -1"),
    ({"temperature": -1.0}, r"--temperature must be >= 0"),
    ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
    ({"max_new_tokens": 0}, r"--max-new-tokens must be >= 1"),
]


@pytest.mark.parametrize(("changes", "needle"), EVAL_ERRORS, ids=[next(iter(c[0])) for c in EVAL_ERRORS])
def test_eval_option_errors_name_the_flag(changes, needle):
    with pytest.raises(ValueError, match=needle):
        EvalConfig(**{"model": "tiny", "data": "tiny:add", "n": 2, **changes}).validate()


EVAL_RUN_ERRORS = [
    ({"data": "tiny:add", "split": "test"}, r"task 'tiny:add' has no split 'test'; available: train, eval, all"),
    ({"data": "jsonl:{f}", "split": "eval"}, r"has no split 'eval'.*eval_fraction>0"),
    ({"data": "jsonl:{f}", "by": "levle"}, r"--by levle: no problem of .* has this field; fields: level, row"),
]


@pytest.mark.parametrize(("changes", "needle"), EVAL_RUN_ERRORS, ids=[str(c[0]) for c in EVAL_RUN_ERRORS])
def test_eval_run_errors_name_the_flag(tmp_path, changes, needle):
    f = tmp_path / "l.jsonl"
    f.write_text(json.dumps({"problem": "What is 1+2?", "answer": "3", "level": 1}) + "\n")
    changes = {k: v.format(f=f) for k, v in changes.items()}
    with pytest.raises(ValueError, match=needle):
        run_eval(EvalConfig(**{"model": "tiny", "n": 1, "max_new_tokens": 2, **changes}), tmp_path / "ev",
                 progress=False)


EVAL_KIND_ERRORS = [
    ("tiny:add", "number", r"task 'tiny:add' is scored by its own scorer"),
    ("jsonl:{f}", "fuzzy", r"unknown reward kind 'fuzzy'"),
    ("jsonl:{f}", "number", r"problem 'w': the reference answer is not a finite number"),
]


@pytest.mark.parametrize(("data", "kind", "needle"), EVAL_KIND_ERRORS,
                         ids=[c[1] + "-" + c[0] for c in EVAL_KIND_ERRORS])
def test_eval_kind_errors(tmp_path, data, kind, needle):
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"id": "w", "problem": "Name a colour.", "answer": "red"}) + "\n")
    with pytest.raises(ValueError, match=needle):
        run_eval(EvalConfig(model="tiny", data=data.format(f=f), n=1, kind=kind, max_new_tokens=2), tmp_path / "ev",
                 progress=False)


# --- the CLI prints one line (rc 2), never a traceback ----------------------------------------------------
CLI_ERRORS = [
    (["train", "--out", "{d}/r", "--set", "rollout.group_size=2.5"], r"rollout\.group_size must be an integer"),
    (["train", "--out", "{d}/r", "--set", "optim.lr.x=1"], r"optim\.lr is a value"),
    (["train", "--out", "{d}/r", "--config", "{d}/bad.yaml"], r"bad\.yaml, line 2, column 9: YAML syntax error"),
    (["eval", "--model", "tiny", "--data", "jsonl:{d}/nan.jsonl?kind=number", "--out", "{d}/ev"],
     r"nan\.jsonl, line 1: field 'answer'"),
    (["eval", "--model", "tiny", "--data", "tiny:add", "--k", "1,x", "--out", "{d}/ev"],
     r"--k must be a comma list of integers"),
]


@pytest.mark.parametrize(("argv", "needle"), CLI_ERRORS, ids=[f"cli{i}" for i in range(len(CLI_ERRORS))])
def test_cli_bad_input_is_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "bad.yaml").write_text("steps: 3\nmodel: a: b\n")
    (tmp_path / "nan.jsonl").write_text('{"problem": "x", "answer": NaN}\n')
    rc = cli_main([a.format(d=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(needle, err[0]), err
    assert "Traceback" not in err[0]


# --- the corpus, by verdict (docs/reliability.md states these counts) ---------------------------------------
ERROR_LISTS = [SET_ERRORS, YAML_ERRORS, SPEC_ERRORS, DATA_ERRORS, FORMAT_ERRORS, TRAIN_ERRORS, EVAL_ERRORS,
               EVAL_RUN_ERRORS, EVAL_KIND_ERRORS, CLI_ERRORS]
SINGLE_ERRORS = 5  # config path is a directory; max_new_tokens past the positions; no prompt fits (train, eval,
# held-out evaluation during training)
CORPUS = {
    "clear error": sum(map(len, ERROR_LISTS)) + SINGLE_ERRORS,
    "counted skip": 4,  # prompts too long for the model: in training, in evaluation (a 10k- and a 1M-character
    # one), in held-out evaluation during training
    "accepted as valid": len(SET_VALID) + len(YAML_VALID) + len(DATA_VALID),
}


def test_docs_state_the_corpus_counts():
    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    assert f"{sum(CORPUS.values())} cases" in section
    for verdict, count in CORPUS.items():
        assert re.search(rf"\|\s*{verdict}\s*\|\s*{count}\s*\|", section), (verdict, count)
