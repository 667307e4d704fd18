"""meshrl's pieces on a TRL run with tools (``GRPOTrainer(tools=...)``, TRL 1.16) on CPU: TRL's own tool loop runs
(scripted model turns: the tiny random model never writes a tool call), and MEICallback's features and Mesh's
balancing sums read the model's tokens only (``tool_mask``), never the tool output TRL splices into a completion."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

from meshrl.agents import calculator  # noqa: E402
from meshrl.diagnostics import bias_features, mei_metrics  # noqa: E402
from meshrl.integrations.trl import MEICallback, MeshGRPOTrainer, MeshOptions  # noqa: E402
from meshrl.mesh import RuleCoach, generate_prefixes  # noqa: E402
from meshrl.models.tiny import build_tiny  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import call_text, qwen_style_tokenizer  # noqa: E402

PLANS = ["Call the calculator tool first.", "Answer directly without tools."]


def _tokenizer():
    tok = qwen_style_tokenizer()
    tok.chat_template = qwen2_5_chat_template  # a template TRL knows how to parse tool calls from
    return tok


class ScriptedTurns(MeshGRPOTrainer):
    """The model's turns, scripted: under the tool plan, call the calculator, then answer; otherwise answer."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tok = self.processing_class
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            if "<tool_response>" in text:
                reply = "4"
            elif PLANS[0] in text:
                reply = call_text("calculator", {"expression": "2+2"})
            else:
                reply = "5"
            out.append(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
        return out, None


def _reward(completions, **kwargs) -> list[float]:
    return [float(c[-1]["content"].strip() == "4") for c in completions]


@pytest.fixture
def trainer(tmp_path):
    tok = _tokenizer()
    model, _ = build_tiny("tiny", seed=0)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.generation_config.eos_token_id = model.config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    rows = [{"prompt": [{"role": "user", "content": f"What is 2+2? ({k})"}], "problem": f"What is 2+2? ({k})"}
            for k in range(4)]
    generate_prefixes([{"id": str(k), "problem": r["problem"], "answer": "4"} for k, r in enumerate(rows)],
                      RuleCoach(lambda q: PLANS, name="rule:plans"), m=2, out_path=tmp_path / "prefixes.jsonl")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=256, max_steps=1,
                      logging_steps=1, report_to=[], seed=0, learning_rate=1e-3, save_strategy="no")
    return ScriptedTurns(model, _reward, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         tools=[calculator], prefixes=tmp_path / "prefixes.jsonl",
                         mesh=MeshOptions(m=2, template="plain", mu=1e-2, adv_unit="query", subtract_ref=False))


def test_tool_output_stays_out_of_mei_and_the_balancing_sums(trainer):
    mei = MEICallback().attach(trainer)
    trainer.model.train()
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    tok, mask, tools = trainer.processing_class, out["completion_mask"], out["tool_mask"]
    planned = out["strategy_ids"] == 0
    for i in range(len(mask)):
        ids = out["completion_ids"][i][mask[i].bool()]
        env = ids[tools[i][mask[i].bool()] == 0]
        if planned[i]:  # TRL's tool loop ran: the tool response is in the completion, masked
            assert "<tool_response>\n4\n</tool_response>" in tok.decode(env)
        else:
            assert len(env) == 0
    assert planned.any() and (~planned).any()
    # MEI: the callback's features are the bias features over the model's tokens only.
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    width = out["completion_ids"].size(1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=att).logits[:, -width - 1:-1]
    own = bias_features(logits, out["completion_ids"], mask * tools).double()
    everything = bias_features(logits, out["completion_ids"], mask).double()
    query_ids = torch.arange(len(mask)) // 4
    want = mei_metrics(own, query_ids, out["strategy_ids"].cpu(), feature="bias")["mei/bias/query"]
    wrong = mei_metrics(everything, query_ids, out["strategy_ids"].cpu(), feature="bias")["mei/bias/query"]
    assert mei.last["mei/query"] == pytest.approx(want, rel=1e-4) and abs(want - wrong) > 1e-3
    # Mesh's per-row sums (balancing weights and term) count the model's tokens only.
    ones = torch.ones_like(mask, dtype=torch.float32)
    assert trainer._completion_sums(ones, out).tolist() == (mask * tools).sum(-1).float().tolist()


def test_a_tool_using_mesh_step_trains(trainer):
    MEICallback().attach(trainer)
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"mesh/balance_mu", "mei/query", "mei/prefix_group", "loss"} <= logged
    assert any(k.startswith("tools/") for k in logged), sorted(logged)
    assert trainer.state.global_step == 1
