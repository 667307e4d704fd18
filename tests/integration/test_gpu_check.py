"""benchmarks/gpu_check.sh's CPU dry run (what CI can run of the GPU check), its FLOP count and tokenizer, and the
``train.device`` setting the check trains with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrl.models import resolve_device
from meshrl.trainer import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_step_flops_is_2n_per_forward_token_and_6n_per_trained_token():
    # 10 prompt + 5 generated tokens: prefill/decode 2N x 15, update 6N x 15.
    assert gpu_check.step_flops(1000, 10, 5) == 2 * 1000 * 15 + 6 * 1000 * 15


def test_matmul_params_leave_out_an_untied_input_embedding():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(gpu_check.SHAPES["tiny-qwen"])
    tied = Qwen2ForCausalLM(Qwen2Config(**shape))
    untied = Qwen2ForCausalLM(Qwen2Config(**{**shape, "tie_word_embeddings": False}))
    assert gpu_check.matmul_params(tied) == sum(p.numel() for p in tied.parameters())
    emb = untied.get_input_embeddings().weight.numel()
    assert gpu_check.matmul_params(untied) == sum(p.numel() for p in untied.parameters()) - emb


def test_tokenizer_encodes_like_tiny_and_decodes_every_id():
    from meshrl.models import build_char_tokenizer

    tok = gpu_check.build_tokenizer(300)
    assert len(tok) == 300
    text = "Repeat: abc 12"
    assert tok(text)["input_ids"] == build_char_tokenizer()(text)["input_ids"]
    assert tok.decode([299, 150], skip_special_tokens=True) == "<|x299|><|x150|>"


@pytest.mark.slow  # the decoders, two meshrl trainers and TRL, a warm-up and a timed step each, tiny shape (~20 s)
def test_dry_run_writes_every_figure(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["env"]["device"] == "cpu" and out["env"]["bf16_autocast"] is True
    (r,) = out["results"]
    assert r["shape"] == "tiny-qwen" and r["matmul_params"] > 0
    for side in ("meshrl", "meshrl_mei", "trl"):
        s = r[side]
        assert s["steps"] == 1 and s["tokens_per_s"] > 0 and s["gen_tokens_per_step"] > 0, (side, s)
        assert s["mfu"] is None and s["peak_allocated_gib"] is None  # no peak FLOP/s or GPU memory on a CPU
        assert s["tflops_per_step"] > 0
    assert r["mei_overhead"] > -1 and r["ratio_tokens_per_s"] > 0
    phases = r["meshrl"]["phases"]
    assert set(phases) == {"rollout", "old_logprobs", "update", "weight_sync"}
    assert phases["rollout"]["s_per_step"] > 0 and phases["update"]["s_per_step"] > 0
    assert all(p["peak_allocated_gib"] is None for p in phases.values())  # no GPU memory on a CPU
    assert r["meshrl"]["train_mfu"] is None and "fits_80gb" not in r["meshrl"]  # no peak FLOP/s, no GPU memory
    assert "MEI overhead" in proc.stdout and "meshrl / TRL tokens/s" in proc.stdout
    decode = json.loads((tmp_path / "gpu_decode.json").read_text())
    (d,) = decode["results"]
    assert decode["env"]["gpu"] is None and d["shape"] == "tiny-qwen"
    for name in ("dynamic", "static_eager"):  # no graphs on a CPU: the static decoder runs eagerly (its twin)
        assert d[name]["tokens_per_s"] > 0 and d[name]["bytes_per_step_floor"] > 0, d[name]
    assert "static" not in d and d["rows_equal_to_dynamic"] == "8/8"


def test_train_device_is_checked_when_read():
    with pytest.raises(ValueError, match=r"train\.device='gpu'; use cpu, cuda, cuda:N or auto"):
        load_config(overrides=["model=tiny", "train.device=gpu"])
    for ok in ("cpu", "cuda", "cuda:1", "auto"):
        assert load_config(overrides=["model=tiny", f"train.device={ok}"]).train.device == ok


def test_resolve_device_never_falls_back_silently():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"train\.device='cuda', but torch sees no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="use cpu, cuda, cuda:N or auto"):
        resolve_device("cuda:x")


def test_gpu_smoke_cases_pass_on_cpu(tmp_path):
    """The device smoke script's cases are valid runs: on a CPU every one trains its steps (a case failing here is a
    broken case, not a device bug). A handful here; the script runs them all on a GPU."""
    import gpu_smoke

    out = tmp_path / "smoke.json"
    cases = ["grpo", "grpo_kl", "mesh", "tools", "static_decode", "speed_path_grads"]
    assert gpu_smoke.main(["--device", "cpu", "--only", ",".join(cases), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["case"] for r in results] == cases
    assert all(r["ok"] and r["steps"] == (0 if r["case"] in gpu_smoke.CHECKS else 2) for r in results)
    assert gpu_smoke.main(["--device", "cpu", "--only", "grpo", "--json", str(out)]) == 0


def test_gpu_smoke_reports_a_failing_case(tmp_path, monkeypatch):
    import gpu_smoke

    monkeypatch.setitem(gpu_smoke.CASES, "broken", ["recipe=no_such_recipe"])
    out = tmp_path / "smoke.json"
    assert gpu_smoke.main(["--device", "cpu", "--only", "broken", "--json", str(out)]) == 1
    (res,) = json.loads(out.read_text())
    assert not res["ok"] and "no_such_recipe" in res["error"]


def test_memory_twin_counts_a_known_step_by_category_and_phase():
    import memory_twin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 800), torch.nn.ReLU(), torch.nn.Linear(800, 200))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(100, 200)

    class Backward:
        def run(self, loss):
            loss.backward()

    backward = Backward()
    memory_twin.mark_phases({"forward": (model, "forward"), "backward": (backward, "run"), "update": (opt, "step")})

    def step():
        backward.run(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()

    step()  # the optimizer's state exists before the profiled step, as in a run's later steps
    with memory_twin.profiler() as prof:
        step()
    r = memory_twin.summarise_profile(prof)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert r["peak_make_up"]["parameter"] * memory_twin.GIB == param_bytes
    assert r["peak_make_up"]["optimizer_state"] * memory_twin.GIB >= 2 * param_bytes  # AdamW's two moments
    assert abs(sum(r["peak_make_up"].values()) - r["peak_gib"]) < 1e-12
    assert set(r["phases"]) == {"forward", "backward", "update"} and r["peak_phase"] in r["phases"]
    assert r["phases"][r["peak_phase"]]["peak_gib"] == r["peak_gib"]
    # the forward holds the parameters, the optimizer's state and the input, and builds activations on them
    assert r["phases"]["forward"]["peak_gib"] * memory_twin.GIB > param_bytes * 3 + x.numel() * 4
    assert all(p["peak_gib"] <= r["peak_gib"] for p in r["phases"].values())


@pytest.mark.slow  # meshrl and TRL, a warm-up and a profiled step each, tiny shape (~20 s)
def test_memory_twin_dry_run_writes_both_sides(tmp_path):
    out = tmp_path / "twin.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_twin.py"), "--dry-run", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["env"]["shape"] == "tiny-qwen" and "rollout.decoder=static" in r["env"]["meshrl_settings"]
    for side in ("meshrl", "trl"):
        s = r[side]
        assert s["peak_gib"] > 0 and s["peak_make_up"]["parameter"] > 0, (side, s)
        assert abs(sum(s["peak_make_up"].values()) - s["peak_gib"]) < 1e-9
        assert "rollout" in s["phases"]
        assert s["start_make_up"]["optimizer_state"] > 0  # the profiled step came after the warm-up one
    assert {"rollout", "update"} <= set(r["meshrl"]["phases"]) and r["ratio_peak"] > 0
    assert r["meshrl"]["peak_phase"] in r["meshrl"]["phases"]  # meshrl's phases cover its whole step
    assert "meshrl / TRL peak live tensor bytes" in proc.stdout
