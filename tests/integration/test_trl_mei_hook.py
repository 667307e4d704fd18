"""MEICallback reads the LM head's input from TRL's own forwards: its bias features equal those of its own extra
forward (the fallback), on tiny Llama and Qwen2 models built from a config (CPU, no hub), through both sources
(TRL's generation-time old log-probs; the loss forwards of shuffled micro-batches) and the fallback."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402

from meshrl.diagnostics import mei_metrics  # noqa: E402
from meshrl.integrations.trl import MEICallback  # noqa: E402
from meshrl.integrations.trl.mei import ROWS_KEY  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402


def even_length(completions, **kwargs) -> list[float]:
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


def tiny(kind: str):
    model, tok = build_tiny("tiny", seed=0)
    if kind == "qwen2":  # untied head with its own weight, grouped-query attention
        config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def make_trainer(tmp_path, kind: str, **kw) -> GRPOTrainer:
    model, tok = tiny(kind)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}]} for a in range(4)]
    args = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=1,
                logging_steps=1, report_to=[], seed=0, learning_rate=1e-3, save_strategy="no", temperature=0.7)
    return GRPOTrainer(model, even_length, args=GRPOConfig(**{**args, **kw}),
                       train_dataset=Dataset.from_list(rows), processing_class=tok)


def attached(trainer) -> tuple[MEICallback, list[torch.Tensor]]:
    """The callback, and the features it publishes (spied)."""
    cb = MEICallback().attach(trainer)
    published, publish = [], cb._publish

    def spy(phi, out):
        published.append(phi.clone())
        publish(phi, out)

    cb._publish = spy
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return cb, published


def generation_batch(trainer) -> dict:
    return trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_features_from_the_loss_forwards_equal_the_extra_forward(tmp_path, kind):
    trainer = make_trainer(tmp_path, kind)
    cb, published = attached(trainer)
    assert cb.capture is not None
    out = generation_batch(trainer)
    assert not published and ROWS_KEY in out  # plain TRL runs no forward while generating: the loss is read
    want = cb.features(out)
    torch.manual_seed(1)
    micro = split_tensor_dict(shuffle_sequence_dict(out), 2)  # as TRL's _prepare_inputs buffers the batch
    trainer._compute_loss(trainer.model, micro[0])
    assert not published  # half the rows so far
    trainer._compute_loss(trainer.model, micro[0])  # a second pass (num_iterations > 1) is not read again
    trainer._compute_loss(trainer.model, micro[1])
    assert len(published) == 1 and cb._pending is None
    assert torch.allclose(published[0], want, atol=1e-5, rtol=1e-5), (published[0] - want).abs().max()
    raw = mei_metrics(want.double(), torch.arange(8) // 4, None, feature="bias")
    assert cb.last["mei/query"] == pytest.approx(raw["mei/bias/query"], rel=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_features_from_trl_old_logps_forward_come_with_the_batch(tmp_path, kind):
    # steps_per_generation=2 with one accumulation step: TRL scores old log-probs over the generation batch
    trainer = make_trainer(tmp_path, kind, steps_per_generation=2)
    cb, published = attached(trainer)
    out = generation_batch(trainer)
    assert "old_per_token_logps" in out and ROWS_KEY not in out and len(published) == 1
    want = cb.features(out)
    assert torch.allclose(published[0], want, atol=1e-5, rtol=1e-5), (published[0] - want).abs().max()
    assert "mei/query" in cb.last


def test_transformed_logits_fall_back_to_the_extra_forward(tmp_path, caplog):
    trainer = make_trainer(tmp_path, "llama")
    trainer.model.config.logit_scale = None  # unset: hooked
    assert MEICallback().attach(trainer).capture is not None
    trainer = make_trainer(tmp_path, "llama")
    trainer.model.config.final_logit_softcapping = 30.0
    with caplog.at_level("INFO", logger="meshrl"):
        cb, published = attached(trainer)
    assert cb.capture is None and "final_logit_softcapping" in caplog.text
    out = generation_batch(trainer)
    assert len(published) == 1 and ROWS_KEY not in out and "mei/query" in cb.last


def test_a_trl_run_logs_mei_from_the_hook(tmp_path):
    trainer = make_trainer(tmp_path, "qwen2", max_steps=2, gradient_accumulation_steps=2)
    cb = MEICallback().attach(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "mei/query" in h]
    assert len(logged) == 2 and cb._pending is None and cb.checks == 2
