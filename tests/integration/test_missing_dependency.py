"""A feature whose optional package is missing fails in one line that says what to install (exit code 2), not with
the traceback of the failed import: here ``rollout.backend=vllm`` without vLLM, and LoRA without peft."""

from __future__ import annotations

import builtins
import importlib.util

import pytest

from meshrl.cli import main as cli_main
from meshrl.errors import MissingDependency


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_train_with_the_vllm_backend_and_no_vllm_is_one_line(tmp_path, capsys):
    rc = cli_main(["train", "--model", "tiny:small", "--task", "tiny:add", "--steps", "1", "--out",
                   str(tmp_path / "run"), "--set", "rollout.backend=vllm", "--set", "log.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "the vllm backend needs vLLM: pip install" in err and "Traceback" not in err


def test_lora_without_peft_names_the_extra(monkeypatch):
    from meshrl.models import build_tiny
    from meshrl.models.lora import apply_lora

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    model, _ = build_tiny("tiny", seed=0)
    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(MissingDependency, match=r"pip install 'meshrl\[peft\]'"):
        apply_lora(model, r=2, alpha=4)
