"""Tool calls in a model turn (Qwen / Hermes format), checked strictly against the tools' schemas.

A model turn calls tools with blocks ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (the format
Qwen2.5/Qwen3 and Hermes chat templates teach); text outside the blocks is free. :func:`parse_tool_calls`
returns every call, or one :class:`ParseFailure` with a reason from :data:`PARSE_FAILURE_REASONS` for the first
block that is not exactly a valid call. Nothing is repaired or guessed: a turn with one bad block executes no
call, since executing the others would reward a malformed turn.

Argument checking covers the JSON-schema subset ``transformers.utils.get_json_schema`` writes: ``type`` (one or a
list), ``nullable``, ``enum``, ``items``, ``prefixItems``, ``properties``/``required``, ``additionalProperties``,
``anyOf``/``oneOf``. ``integer`` takes JSON integers only (``1.0`` is refused: the tool would receive a float);
``number`` takes integers and floats; ``true``/``false`` are booleans, never numbers.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("meshrl")
OPEN, CLOSE = "<tool_call>", "</tool_call>"

PARSE_FAILURE_REASONS = ("unclosed_block", "stray_close", "nested_block", "bad_json", "too_large", "too_deep",
                         "not_an_object", "bad_shape", "unknown_tool", "missing_argument", "extra_argument",
                         "wrong_type")
# Checked before decoding, so that no block can make the decoder recurse past Python's stack (a RecursionError
# near 1,000 levels) or work for long; a real call is a few hundred characters, a few levels deep.
MAX_BLOCK_CHARS = 100_000
MAX_JSON_DEPTH = 64
MAX_DETAIL_CHARS = 2000  # a refusal's detail is shown to the model: a huge value is not echoed whole
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and its ``arguments`` (checked against the tool's schema)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseFailure:
    """Why a turn's tool-call markup was refused: ``reason`` (one of :data:`PARSE_FAILURE_REASONS`), ``detail``
    (readable, fit to show the model), ``block`` (0-based index of the offending ``<tool_call>`` block)."""

    reason: str
    detail: str
    block: int

    def message(self) -> str:
        detail = self.detail
        if len(detail) > MAX_DETAIL_CHARS:
            detail = f"{detail[:MAX_DETAIL_CHARS]} [{len(detail) - MAX_DETAIL_CHARS} more characters]"
        return f"invalid tool call (block {self.block + 1}): {self.reason}: {detail}"


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of a turn (empty when it calls nothing or when ``failure`` is set)."""

    calls: list[ToolCall] = field(default_factory=list)
    failure: ParseFailure | None = None


class _Refused(Exception):
    def __init__(self, reason: str, detail: str, block: int = 0):
        super().__init__(detail)
        self.reason, self.detail, self.block = reason, detail, block


def tool_blocks(text: str) -> list[str]:
    """The bodies of the ``<tool_call>...</tool_call>`` blocks of ``text``, in order; raises :class:`_Refused`
    for an unclosed block, a ``</tool_call>`` with no opening, or a block opened inside another."""
    bodies, pos = [], 0
    while True:
        start, stop = text.find(OPEN, pos), text.find(CLOSE, pos)
        if start < 0 and stop < 0:
            return bodies
        if stop >= 0 and (start < 0 or stop < start):
            raise _Refused("stray_close", f"{CLOSE} at character {stop} closes no {OPEN}", len(bodies))
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end < 0:
            raise _Refused("unclosed_block", f"{OPEN} at character {start} is never closed with {CLOSE}",
                           len(bodies))
        inner = text.find(OPEN, body_start)
        if 0 <= inner < end:
            raise _Refused("nested_block", f"{OPEN} at character {inner} opens inside the block at {start}",
                           len(bodies))
        bodies.append(text[body_start:end])
        pos = end + len(CLOSE)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):  # linear: count the keys only when some key repeats
        repeated = sorted(k for k, count in Counter(k for k, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate keys {repeated}")
    return value


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def json_depth(body: str) -> int:
    """The deepest nesting of ``[]``/``{}`` in JSON text ``body``, brackets inside strings not counted (an
    unterminated string runs to the end), in linear time and without recursion."""
    bare = _JSON_STRING.sub("0", body)  # a complete string holds no structure
    quote = bare.find('"')
    if quote >= 0:
        bare = bare[:quote]
    depth = deepest = 0
    for bracket in _BRACKET.findall(bare):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _decode(body: str) -> Any:
    if len(body) > MAX_BLOCK_CHARS:
        raise _Refused("too_large", f"the block has {len(body)} characters, more than {MAX_BLOCK_CHARS}")
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise _Refused("too_deep", f"the block nests {depth} levels of arrays/objects, more than {MAX_JSON_DEPTH}")
    try:
        return json.loads(body, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError as exc:  # not reached past the depth check; kept so that the parser never raises
        raise _Refused("too_deep", "the block nests too deeply to decode") from exc
    except ValueError as exc:  # json.JSONDecodeError is a ValueError, as are the hooks' refusals
        raise _Refused("bad_json", f"the block is not one JSON object ({exc})") from exc


def _call_from(value: Any, tools: Mapping[str, dict]) -> ToolCall:
    if not isinstance(value, dict):
        raise _Refused("not_an_object", f"the block holds a JSON {type(value).__name__}, not an object")
    if set(value) != {"name", "arguments"}:
        raise _Refused("bad_shape", f'the object must have exactly the keys "name" and "arguments", got '
                                    f"{sorted(value)}")
    name, arguments = value["name"], value["arguments"]
    if not isinstance(name, str):
        raise _Refused("bad_shape", f'"name" must be a string, got {json.dumps(name)}')
    if not isinstance(arguments, dict):
        raise _Refused("bad_shape", f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    if name not in tools:
        raise _Refused("unknown_tool", f"no tool named {name!r}; tools: {sorted(tools)}")
    check_arguments(arguments, tools[name], name)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, tools: Mapping[str, dict]) -> ParsedTurn:
    """The tool calls in model turn ``text``; ``tools`` maps each tool name to its parameters schema
    (:attr:`meshrl.agents.environment.Tool.parameters`). See the module docstring for what is refused."""
    try:
        bodies = tool_blocks(text)
    except _Refused as refused:
        return ParsedTurn([], ParseFailure(refused.reason, refused.detail, refused.block))
    calls = []
    for index, body in enumerate(bodies):
        try:
            calls.append(_call_from(_decode(body.strip()), tools))
        except _Refused as refused:
            return ParsedTurn([], ParseFailure(refused.reason, refused.detail, index))
    return ParsedTurn(calls, None)


def check_arguments(arguments: dict[str, Any], parameters: dict, tool: str) -> None:
    """Raise :class:`_Refused` (``missing_argument``, ``extra_argument``, ``wrong_type``) unless ``arguments``
    fits the tool's parameters schema exactly."""
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        raise _Refused("missing_argument", f"{tool}() needs {missing}")
    extra = sorted(k for k in arguments if k not in properties)
    if extra:
        raise _Refused("extra_argument", f"{tool}() takes no {extra}; its arguments: {sorted(properties)}")
    for key, value in arguments.items():
        problem = schema_mismatch(value, properties[key])
        if problem:
            raise _Refused("wrong_type", f"{tool}() argument {key!r}: {problem}")


_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def schema_mismatch(value: Any, schema: dict) -> str | None:
    """Why ``value`` does not fit ``schema`` (the JSON-schema subset of the module docstring), or ``None``."""
    for union in ("anyOf", "oneOf"):
        if union in schema:
            fits = [s for s in schema[union] if schema_mismatch(value, s) is None]
            if not fits or (union == "oneOf" and len(fits) > 1):
                return f"{json.dumps(value)} fits {len(fits)} of the {union} alternatives"
    if value is None and schema.get("nullable"):
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"{json.dumps(value)} is not one of {schema['enum']}"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        unknown = [k for k in kinds if k not in _TYPE_CHECKS]
        if unknown:
            return f"the schema names unknown types {unknown}"
        if not any(_TYPE_CHECKS[k](value) for k in kinds):
            return f"expected {' or '.join(kinds)}, got {json.dumps(value)}"
    if isinstance(value, list):
        return _array_mismatch(value, schema)
    if isinstance(value, dict):
        return _object_mismatch(value, schema)
    return None


def _array_mismatch(value: list, schema: dict) -> str | None:
    if "prefixItems" in schema:
        items = schema["prefixItems"]
        if len(value) != len(items):
            return f"expected {len(items)} items, got {len(value)}"
        pairs = list(zip(value, items, strict=True))
    else:
        pairs = [(v, schema["items"]) for v in value] if "items" in schema else []
    for i, (item, item_schema) in enumerate(pairs):
        problem = schema_mismatch(item, item_schema)
        if problem:
            return f"item {i}: {problem}"
    return None


def _object_mismatch(value: dict, schema: dict) -> str | None:
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        return f"missing keys {missing}"
    extra_schema = schema.get("additionalProperties", None if properties else True)
    for key, item in value.items():
        if key in properties:
            item_schema = properties[key]
        elif isinstance(extra_schema, dict):
            item_schema = extra_schema
        elif extra_schema is True:
            continue
        else:
            return f"unexpected key {key!r}"
        problem = schema_mismatch(item, item_schema)
        if problem:
            return f"key {key!r}: {problem}"
    return None


# ---- rendering: tool schemas into the prompt, tool results back into the token stream ----

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_SENTINEL = "meshrl_tool_probe_5f1c"


def hermes_tools_block(tools: list[dict]) -> str:
    """The tool instructions Qwen2.5's chat template puts into its system message (Hermes format): the schemas
    inside ``<tools></tools>``, one JSON per line, and how to write a ``<tool_call>``. Used when a tokenizer's
    template cannot show tools itself."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f'{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def encode_agent_prompt(tokenizer, user_text: str, tools: list[dict], *, observation: str | None = None,
                        system: str | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids for an episode: ``user_text`` plus the environment's ``observation`` (what ``reset`` returned,
    appended to the user message as TRL does), with the tool schemas shown to the model.

    With a chat template that renders the tools (every tool name appears in its output), this is
    ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)`` encoded without adding special
    tokens again (as :func:`meshrl.models.prompts.encode_prompt`). Otherwise the :func:`hermes_tools_block` is
    appended to the system prompt and the prompt is built by ``encode_prompt``.
    """
    def encode(text: str) -> list[int]:
        return _encode_agent_prompt(tokenizer, user_text + text, tools, system, chat_template_kwargs)

    # the observation is environment text: encoded as text, never as special tokens (encode_around)
    return encode_around(encode, tokenizer, observation) if observation else encode("")


def _encode_agent_prompt(tokenizer, content: str, tools: list[dict], system: str | None,
                         chat_template_kwargs: dict | None) -> list[int]:
    from meshrl.models.prompts import encode_prompt

    if getattr(tokenizer, "chat_template", None) and tools:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": content})
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
        bare = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
        # The template shows the tools when each name appears more often with them than without (a name in the
        # system or user text, e.g. a coach's "call the calculator tool first", proves nothing).
        if all(text.count(t["function"]["name"]) > bare.count(t["function"]["name"]) for t in tools):
            return list(tokenizer.encode(text, add_special_tokens=False))
    if tools:
        system = hermes_tools_block(tools) if system is None else f"{system}\n\n{hermes_tools_block(tools)}"
    return encode_prompt(tokenizer, content, system=system)


_SURROGATE = re.compile("[\ud800-\udfff]")
_BREAK = "\u2060"  # WORD JOINER: splits a special token's spelling where no other way of encoding it as text exists


def as_text(text: str) -> str:
    """``text`` with every surrogate code point (which UTF-8 cannot encode, so a tokenizer raises on it; a model
    reaches one by writing ``"\\ud800"`` into an argument a tool echoes) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def special_strings(tokenizer) -> tuple[str, ...]:
    """The spellings a tokenizer encodes as special tokens (``added_tokens_decoder`` entries marked special, plus
    ``all_special_tokens``), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {token.content for token in decoder.values() if getattr(token, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", None) or [])
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))


def holds_special(text: str, specials: tuple[str, ...]) -> bool:
    return any(s in text for s in specials)


def encode_as_text(tokenizer, text: str) -> list[int]:
    """``text`` encoded as plain text: the spelling of a special token inside it (``<|im_end|>``) becomes ordinary
    tokens, never the special one (``split_special_tokens=True``), so environment text cannot end a turn."""
    return list(tokenizer.encode(as_text(text), add_special_tokens=False, split_special_tokens=True))


def encode_around(encode: Callable[[str], list[int]], tokenizer, text: str) -> list[int]:
    """``encode(text)`` where ``encode`` puts environment ``text`` inside a prompt (e.g. a ``reset`` observation in
    the user message), with ``text`` read as text: surrogates become U+FFFD, and when ``text`` spells a special
    token it is encoded on its own (:func:`encode_as_text`) and spliced where a one-token marker lands in the
    prompt; text that spells none is encoded exactly as ``encode`` does."""
    text, specials = as_text(text), special_strings(tokenizer)
    if not holds_special(text, specials):
        return list(encode(text))
    bare, marked = list(encode("")), list(encode(specials[-1]))
    marker = tokenizer.convert_tokens_to_ids(specials[-1])
    at = next((k for k, (a, b) in enumerate(zip(bare, marked, strict=False)) if a != b), len(bare))
    if marked[at:at + 1] == [marker] and marked[at + 1:] == bare[at:]:  # the text sits at ``at``
        return bare[:at] + encode_as_text(tokenizer, text) + bare[at:]
    log.warning("environment text spells special tokens and the prompt cannot be split around it; the spellings "
                "are broken with U+2060 before encoding")
    return list(encode(break_specials(text, specials)))


def break_specials(text: str, specials: tuple[str, ...]) -> str:
    """``text`` with a WORD JOINER after the first character of every special token spelling: the last resort
    where a template's text cannot be split from the environment's."""
    for special in specials:
        text = text.replace(special, special[0] + _BREAK + special[1:])
    return text


def tool_result_text(value: Any) -> str:
    """A tool's return value as message content: strings as they are, JSON-serialisable values as JSON, anything
    else as ``str(value)``."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class ToolResponseRenderer:
    """The tokens that follow a model turn which called tools: the tool results as the tokenizer's chat template
    renders ``tool`` messages, up to and including the opening of the next assistant turn.

    ``mode == "chat_template"``: TRL's construction (``GRPOTrainer._get_tool_suffix_ids``), on text: render
    ``[user, assistant with tool_calls]`` and the same plus the ``tool`` messages with
    ``add_generation_prompt=True``; cut the first after its last eos token (the model's turn ends there, and some
    templates put a newline after it); the suffix is what the second adds. It is chosen when the template renders
    a probe tool message this way (its content appears, the first rendering is a prefix of the second).

    ``mode == "fallback"`` (no template, or one that fails the probe; ``reason`` says why): each result as
    ``"\\n<tool_response>\\n{content}\\n</tool_response>"``, then ``"\\n"``, with no role markers (Hermes' tool
    block without the template around it).

    The suffix text is encoded once, on its own, without adding special tokens: the model's turn before it ends
    with a special token, so encoding the whole conversation would split at the same place.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = chat_template_kwargs or {}
        self.specials = special_strings(tokenizer)
        self.mode, self.reason = self._probe()

    def _probe(self) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return "fallback", "the tokenizer has no chat template"
        try:
            suffix = self._template_text([("probe_tool", _SENTINEL)])
        except Exception as exc:  # a template may raise on tool roles (jinja errors); the fallback is then used
            return "fallback", f"the chat template cannot render tool messages ({type(exc).__name__}: {exc})"
        if _SENTINEL not in suffix:
            return "fallback", "the chat template drops the content of tool messages"
        return "chat_template", "the chat template renders tool messages"

    def _template_text(self, responses: list[tuple[str, str]]) -> str:
        call = {"type": "function", "function": {"name": responses[0][0], "arguments": {}}}
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        prefix = self.tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=False, **self.kwargs)
        tools = [{"role": "tool", "name": name, "content": content} for name, content in responses]
        full = self.tokenizer.apply_chat_template(head + tools, tokenize=False, add_generation_prompt=True,
                                                  **self.kwargs)
        eos = self.tokenizer.eos_token
        if eos and eos in prefix:
            prefix = prefix[: prefix.rindex(eos) + len(eos)]
        if not full.startswith(prefix):
            raise ValueError("the conversation without the tool messages is not a prefix of the one with them")
        return full[len(prefix):]

    def text(self, responses: list[tuple[str, str]]) -> str:
        """The suffix text for ``responses`` (``(tool name, content)`` pairs, in call order)."""
        if not responses:
            raise ValueError("no tool responses to render")
        if self.mode == "chat_template":
            return self._template_text(responses)
        return "".join(f"\n{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}" for _, content in responses) + "\n"

    def ids(self, responses: list[tuple[str, str]]) -> list[int]:
        """:meth:`text` encoded once, without special tokens added. Tool output is text: surrogates become U+FFFD
        (:func:`as_text`), and when a result spells a special token (``<|im_end|>``, ``</s>``) the results are
        encoded apart from the template's own markers, as plain text (:func:`encode_as_text`), so that no tool can
        write an end of turn or an assistant turn into the context. Other results encode exactly as before."""
        responses = [(name, as_text(content)) for name, content in responses]
        if not any(holds_special(content, self.specials) for _, content in responses):
            return list(self.tokenizer.encode(self.text(responses), add_special_tokens=False))
        pieces = self._split_text(responses)
        if pieces is None:  # the template changed a marker: break the spellings instead
            log.warning("tool output spells special tokens and the chat template's tool rendering cannot be split "
                        "around it; the spellings are broken with U+2060 before encoding")
            broken = [(name, break_specials(content, self.specials)) for name, content in responses]
            return list(self.tokenizer.encode(self.text(broken), add_special_tokens=False))
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            if index % 2:  # a tool's content
                ids += encode_as_text(self.tokenizer, piece)
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def _split_text(self, responses: list[tuple[str, str]]) -> list[str] | None:
        """The suffix text as ``[template, content 1, template, content 2, ..., template]``, found by rendering a
        marker in place of each content; ``None`` when a marker does not come back unchanged and in order."""
        markers = [f"{_SENTINEL}_{i}_" for i in range(len(responses))]
        rendered = self.text([(name, marker) for (name, _), marker in zip(responses, markers, strict=True)])
        pieces, pos = [], 0
        for marker, (_, content) in zip(markers, responses, strict=True):
            at = rendered.find(marker, pos)
            if at < 0 or rendered.count(marker) != 1:
                return None
            pieces += [rendered[pos:at], content]
            pos = at + len(marker)
        return [*pieces, rendered[pos:]]
