"""meshrl.agents against TRL 1.16 itself: the tool-response tokens equal GRPOTrainer's own
(``_get_tool_suffix_ids``), and TRL accepts the Qwen-style test template as tool-capable."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from trl.chat_template_utils import supports_tool_calling  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from meshrl.agents import ToolResponseRenderer  # noqa: E402
from meshrl.models.tiny import build_char_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from agents_support import qwen_style_tokenizer  # noqa: E402


def _trl_suffix(tokenizer, responses: list[tuple[str, str]]) -> list[int]:
    """GRPOTrainer._get_tool_suffix_ids on a trainer reduced to the attributes that method reads."""
    trainer = SimpleNamespace(processing_class=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                              _tokenizer=tokenizer)
    messages = [{"role": "tool", "name": name, "content": content} for name, content in responses]
    return list(GRPOTrainer._get_tool_suffix_ids(trainer, messages))


@pytest.mark.parametrize("make", [qwen_style_tokenizer, build_char_tokenizer])
@pytest.mark.parametrize("responses", [[("read", "count=2")], [("read", "a\nb"), ("increment", '{"x": 1}')]])
def test_tool_response_tokens_equal_trls(make, responses):
    tokenizer = make()
    renderer = ToolResponseRenderer(tokenizer)
    assert renderer.mode == "chat_template"
    assert renderer.ids(responses) == _trl_suffix(tokenizer, responses)


def test_trl_accepts_the_qwen_style_template():
    assert supports_tool_calling(qwen_style_tokenizer())

