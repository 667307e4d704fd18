"""Shared by the tests of meshrl.agents: a backend that replays scripted turns (and records every call), a
ChatML tokenizer with a Qwen2.5-style tool template, and an environment written in TRL's convention."""

from __future__ import annotations

from collections.abc import Callable

from meshrl.models.tiny import build_char_tokenizer
from meshrl.rollout.base import RolloutBackend, Rollouts, SamplingParams

# Qwen2.5-Instruct's chat template, tool parts as published (default system prompt shortened).
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}"
    "{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_style_tokenizer():
    """The tiny character tokenizer plus ``<|im_start|>``/``<|im_end|>`` (eos) and the Qwen-style template."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def no_template_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = None
    return tok


class ScriptedBackend(RolloutBackend):
    """Replays ``script(context_ids, row, seed) -> text`` as sampled turns: the text's ids plus eos (no eos when
    the text ends with ``"..."``, a turn cut at its length), log-probs ``-(position + 1) / 100``. Records every
    ``generate`` call as ``(contexts, params, seed, rollouts)``."""

    name = "scripted"

    def __init__(self, tokenizer, script: Callable[[list[int], int, int], str]):
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[tuple[list[list[int]], SamplingParams, int, Rollouts]] = []

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, seed: int) -> Rollouts:
        out = Rollouts(engine_logprobs=[])
        rows = [(i, p) for i, p in enumerate(prompt_ids) for _ in range(params.n)]
        for row, (index, prompt) in enumerate(rows):
            text = self.script(list(prompt), row, seed)
            ids = self.tokenizer.encode(text.removesuffix("..."), add_special_tokens=False)
            truncated = text.endswith("...") or len(ids) + 1 > params.max_new_tokens  # eos must fit
            ids = ids[: params.max_new_tokens] if truncated else [*ids, self.tokenizer.eos_token_id]
            out.prompt_index.append(index)
            out.prompt_ids.append(list(prompt))
            out.response_ids.append(ids)
            out.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            out.truncated.append(truncated)
            out.engine_logprobs.append([-(k + 1) / 100 for k in range(len(ids))])
        self.calls.append(([list(p) for p in prompt_ids], params, seed, out))
        return out

    def sync_weights(self, model) -> None:
        """Nothing to sync: the script is the policy."""


class CounterEnv:
    """An environment exactly as TRL 1.16 documents them: public methods are tools, ``reset``, ``get_reward``."""

    def __init__(self):
        self.count = 0
        self.target = 0

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        self.target = int(kwargs.get("target", 3))
        return None

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter's new value.
        """
        self.count += step
        return self.count

    def read(self) -> str:
        """Read the counter.

        Returns:
            The counter's value as text.
        """
        return f"count={self.count}"

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0

    def _helper(self) -> None:  # private: not a tool
        raise AssertionError("never exposed")


def call_text(name: str, arguments: dict) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
