"""meshrl.agents.tool_calls: the strict <tool_call> parser, argument checking against get_json_schema's schemas,
and rendering tool results / tool schemas as the chat template would (or the documented fallback)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from agents_support import CounterEnv, call_text, no_template_tokenizer, qwen_style_tokenizer

from meshrl.agents import PARSE_FAILURE_REASONS, Toolbox, ToolResponseRenderer, encode_agent_prompt, parse_tool_calls
from meshrl.agents.tool_calls import ToolCall, hermes_tools_block, schema_mismatch
from meshrl.models.tiny import build_char_tokenizer


def typed(count: int, names: list[str], mode: Literal["fast", "slow"], scale: float | None = None,
          pair: tuple[int, str] = (0, "")) -> str:
    """A tool with many argument types.

    Args:
        count: An integer.
        names: Strings.
        mode: One of two words.
        scale: A number or null.
        pair: An integer and a string.
    """
    return "ok"


def _tools() -> dict[str, dict]:
    box = Toolbox(CounterEnv(), [typed])
    return {name: tool.parameters for name, tool in box.tools.items()}


def test_accepts_calls_with_free_text_around_them():
    text = ("Let me count.\n" + call_text("increment", {"step": 2}) + "\nthen\n" + call_text("read", {})
            + "\n" + call_text("typed", {"count": 1, "names": ["a"], "mode": "slow", "scale": None, "pair": [3, "x"]}))
    parsed = parse_tool_calls(text, _tools())
    assert parsed.failure is None
    assert parsed.calls == [ToolCall("increment", {"step": 2}), ToolCall("read", {}),
                            ToolCall("typed", {"count": 1, "names": ["a"], "mode": "slow", "scale": None,
                                               "pair": [3, "x"]})]


def test_a_turn_without_blocks_calls_nothing():
    parsed = parse_tool_calls("The answer is 3.", _tools())
    assert parsed.calls == [] and parsed.failure is None


@pytest.mark.parametrize(("text", "reason", "block"), [
    ('<tool_call>{"name": "read", "arguments": {}}', "unclosed_block", 0),
    ('done </tool_call>', "stray_close", 0),
    ('<tool_call>{"name": "read", <tool_call>{}</tool_call>', "nested_block", 0),
    ("<tool_call>{'name': 'read', 'arguments': {}}</tool_call>", "bad_json", 0),  # Python literal, not JSON
    ('<tool_call>{"name": "read", "arguments": {}} trailing</tool_call>', "bad_json", 0),
    ('<tool_call>{"name": "read", "name": "read", "arguments": {}}</tool_call>', "bad_json", 0),
    ('<tool_call>{"name": "increment", "arguments": {"step": NaN}}</tool_call>', "bad_json", 0),
    ('<tool_call>["read", {}]</tool_call>', "not_an_object", 0),
    ('<tool_call>{"name": "read"}</tool_call>', "bad_shape", 0),
    ('<tool_call>{"name": "read", "arguments": {}, "id": 1}</tool_call>', "bad_shape", 0),
    ('<tool_call>{"name": "read", "arguments": "{}"}</tool_call>', "bad_shape", 0),  # arguments as a string
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "bad_shape", 0),
    ('<tool_call>{"name": "reset", "arguments": {}}</tool_call>', "unknown_tool", 0),
    ('<tool_call>{"name": "_helper", "arguments": {}}</tool_call>', "unknown_tool", 0),
    ('<tool_call>{"name": "increment", "arguments": {}}</tool_call>', "missing_argument", 0),
    ('<tool_call>{"name": "read", "arguments": {"x": 1}}</tool_call>', "extra_argument", 0),
    ('<tool_call>{"name": "increment", "arguments": {"step": "2"}}</tool_call>', "wrong_type", 0),
    ('<tool_call>{"name": "increment", "arguments": {"step": 2.0}}</tool_call>', "wrong_type", 0),
    ('<tool_call>{"name": "increment", "arguments": {"step": true}}</tool_call>', "wrong_type", 0),
    ('<tool_call>{"name": "read", "arguments": {}}</tool_call><tool_call>{"name": "increment", '
     '"arguments": {"step": 1, "by": 2}}</tool_call>', "extra_argument", 1),
])
def test_refuses_with_the_named_reason(text, reason, block):
    parsed = parse_tool_calls(text, _tools())
    assert parsed.calls == []
    assert parsed.failure is not None and parsed.failure.reason == reason and parsed.failure.block == block
    assert reason in PARSE_FAILURE_REASONS and reason in parsed.failure.message()


@pytest.mark.parametrize(("arguments", "wrong"), [
    ({"count": 1, "names": ["a", 2], "mode": "fast"}, "item 1"),
    ({"count": 1, "names": [], "mode": "medium"}, "not one of"),
    ({"count": 1, "names": [], "mode": "fast", "scale": "big"}, "expected number"),
    ({"count": 1, "names": [], "mode": "fast", "pair": [1]}, "expected 2 items"),
    ({"count": 1, "names": [], "mode": "fast", "pair": [1, 2]}, "item 1"),
])
def test_nested_argument_types_are_checked(arguments, wrong):
    parsed = parse_tool_calls(call_text("typed", arguments), _tools())
    assert parsed.failure is not None and parsed.failure.reason == "wrong_type" and wrong in parsed.failure.detail


def test_schema_subset():
    assert schema_mismatch(1, {"type": ["integer", "string"]}) is None
    assert schema_mismatch({"a": 1.5}, {"type": "object", "additionalProperties": {"type": "number"}}) is None
    assert "key 'a'" in schema_mismatch({"a": "x"}, {"type": "object", "additionalProperties": {"type": "number"}})
    assert schema_mismatch(None, {"type": "integer", "nullable": True}) is None
    assert schema_mismatch(2, {"anyOf": [{"type": "string"}, {"type": "integer"}]}) is None
    assert schema_mismatch(2, {"oneOf": [{"type": "number"}, {"type": "integer"}]}) is not None  # fits both


def test_qwen_style_template_renders_tool_responses_exactly():
    tok = qwen_style_tokenizer()
    renderer = ToolResponseRenderer(tok)
    assert renderer.mode == "chat_template"
    text = renderer.text([("read", "count=2"), ("increment", "3")])
    assert text == ("\n<|im_start|>user\n<tool_response>\ncount=2\n</tool_response>\n<tool_response>\n3\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert renderer.ids([("read", "count=2")]) == tok.encode(renderer.text([("read", "count=2")]),
                                                            add_special_tokens=False)


def test_the_suffix_continues_a_conversation_token_for_token():
    """prompt + model turn (ending with eos) + suffix == the template's rendering of the whole conversation."""
    tok = qwen_style_tokenizer()
    call = {"name": "read", "arguments": {}}
    turn = f'<tool_call>\n{json.dumps(call)}\n</tool_call>'
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
         {"role": "tool", "name": "read", "content": "count=0"}], tokenize=False, add_generation_prompt=True)
    ids = (tok.encode(prompt, add_special_tokens=False) + tok.encode(turn, add_special_tokens=False)
           + [tok.eos_token_id] + ToolResponseRenderer(tok).ids([("read", "count=0")]))
    assert ids == tok.encode(whole, add_special_tokens=False)


def test_tiny_template_and_fallback():
    tiny = ToolResponseRenderer(build_char_tokenizer())
    assert tiny.mode == "chat_template"
    assert tiny.text([("read", "5")]) == "\n<s>tool\n5</s>\n<s>assistant\n"
    bare = ToolResponseRenderer(no_template_tokenizer())
    assert bare.mode == "fallback" and "no chat template" in bare.reason
    assert bare.text([("read", "5"), ("x", "6")]) == ("\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6"
                                                      "\n</tool_response>\n")
    with pytest.raises(ValueError, match="no tool responses"):
        bare.text([])


def test_a_template_that_drops_tool_messages_falls_back():
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.role }}:{{ m.content }}{% endif %}" \
                        "{% endfor %}"
    renderer = ToolResponseRenderer(tok)
    assert renderer.mode == "fallback" and "drops" in renderer.reason


def test_encode_agent_prompt_shows_the_tools():
    schemas = Toolbox(CounterEnv()).schemas
    qwen = qwen_style_tokenizer()
    ids = encode_agent_prompt(qwen, "Count to 3.", schemas, observation=" Start at 0.")
    text = qwen.decode(ids)
    assert '"name": "increment"' in text and "Count to 3. Start at 0.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    tiny = build_char_tokenizer()  # its template ignores tools: the Hermes block goes into the system prompt
    text = tiny.decode(encode_agent_prompt(tiny, "Count.", schemas, system="Be brief."))
    assert text.startswith("<s>system\nBe brief.\n\n" + hermes_tools_block(schemas)[:40])
    assert text.endswith("<s>user\nCount.</s>\n<s>assistant\n")


def test_a_tool_name_in_the_system_text_is_no_proof_the_template_shows_tools():
    """The tiny template ignores ``tools=``: a coach prefix that names the tool must not pass for the tools being
    shown; the Hermes block is appended to the system prompt instead."""
    from meshrl.agents import calculator, encode_agent_prompt, tool_schema
    from meshrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    schema = [tool_schema(calculator)]
    text = tok.decode(encode_agent_prompt(tok, "2+2?", schema, system="Plan: call the calculator tool first."))
    assert "Plan: call the calculator tool first." in text and '"name": "calculator"' in text and "<tools>" in text
