"""The rollout backend contract is declared on ``RolloutBackend``: a new backend is one registered class; each
backend builds itself from a run's settings; the config's choices are the registry's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshrl.models import build_tiny
from meshrl.rollout import BACKENDS, RolloutBackend, Rollouts, backend_for_run, make_backend
from meshrl.rollout.hf import HFGenerateBackend
from meshrl.rollout.native import NativeDecodeBackend
from meshrl.testing import tiny_config
from meshrl.trainer.config import ROLLOUT_BACKENDS


class Echo(RolloutBackend):
    """The least a backend must write: generate and sync_weights."""

    name = "echo"

    def __init__(self, model, tokenizer) -> None:
        self.synced = 0

    def generate(self, prompt_ids, params, *, seed, features=False):
        return Rollouts(prompt_index=list(range(len(prompt_ids))), prompt_ids=[list(p) for p in prompt_ids],
                        response_ids=[list(p) for p in prompt_ids], texts=["x"] * len(prompt_ids),
                        truncated=[False] * len(prompt_ids))

    def sync_weights(self, model) -> None:
        self.synced += 1


def test_a_new_backend_is_one_registered_class(monkeypatch):
    monkeypatch.setitem(BACKENDS, "echo", Echo)
    b = make_backend("echo", None, None)
    assert isinstance(b, Echo) and b.model is None and not b.returns_features and not b.logprobs_truncated
    b.release_workers()  # the declared defaults: nothing to free, nothing to stop
    b.close()
    assert b.precision("float32") == "float32"
    assert isinstance(backend_for_run(SimpleNamespace(backend="echo"), None, None), Echo)  # from_config default
    with pytest.raises(ValueError, match="rollout.backend: unknown 'nope'"):
        backend_for_run(SimpleNamespace(backend="nope"), None, None)
    with pytest.raises(ValueError, match="unknown rollout backend 'nope'"):
        make_backend("nope", None, None)


def test_the_configs_choices_are_the_registrys():
    assert tuple(sorted(BACKENDS)) == ROLLOUT_BACKENDS and {"auto", "hf", "native", "vllm"} <= set(BACKENDS)


def test_each_in_process_backend_reads_its_settings():
    model, tok = build_tiny("tiny", seed=0)
    rollout = tiny_config("rollout.autocast_bf16=true", "rollout.decode_workers=1", "rollout.decoder=static",
                          "rollout.batch_size=7", "rollout.prepack_weights=false").rollout
    native = NativeDecodeBackend.from_config(rollout, model, tok)
    assert (native.autocast, native.workers, native.static, native.batch_size, native.prepack) == (
        "bfloat16", 1, True, 7, False)
    assert native.precision("float32") == "autocast-bfloat16" and native.model is model
    hf = HFGenerateBackend.from_config(rollout, model, tok)
    assert (hf.autocast, hf.batch_size) == ("bfloat16", 7)
    plain = HFGenerateBackend.from_config(tiny_config().rollout, model, tok)
    assert plain.precision("float32") == "float32"
    auto = backend_for_run(SimpleNamespace(**{**vars(rollout), "backend": "auto"}), model, tok)
    assert auto.name == "native" and auto.static and auto.batch_size == 7  # auto hands native its settings
