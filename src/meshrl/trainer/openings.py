"""Forced response openings: rollouts whose first tokens are given, the rest sampled.

A sampling plug-in may open some rows' responses with text of its choosing (:meth:`meshrl.trainer.plugins.Plugin.
opening`, e.g. the coach's strategy in ``plugins.coach_guide``); the sampler then draws only the rest of those rows.
The forced tokens were not the sampler's choice: such a row carries no sampler log-probs or features, and
``StepData.unsampled`` records how many tokens were forced.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def opening_ids(tokenizer: Any, text: str, max_new_tokens: int, who: str) -> list[int]:
    """Token ids of an opening (encoded on its own, as ``encode_prompt`` appends an assistant prefix); it must
    leave room for at least one generated token. ``who`` names the setting in the errors."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"{who}: the response opening {text!r} encodes to no tokens")
    if len(ids) >= max_new_tokens:
        raise ValueError(f"{who}: the response opening {text!r} is {len(ids)} tokens, not less than "
                         f"rollout.max_new_tokens={max_new_tokens}")
    return ids


def generate_with_openings(backend: Any, prompts: list[list[int]], openings: list[tuple[list[int], str]],
                           params: Any, *, seed: int, features: bool = False) -> list[dict[str, Any]]:
    """Sample ``params.n`` responses per prompt, each forced to start with its ``openings`` entry, ``(token ids,
    text)`` (``([], "")``: a free rollout).

    Prompts are sampled in one call per opening length (a guided row gets ``max_new_tokens - len(opening)`` new
    tokens); the free call keeps ``seed``, so without openings this samples exactly what one plain call does.
    Returns one record per sample in prompt-major order (``prompt_index``, ``prompt_ids`` without the opening,
    ``response_ids`` and ``text`` with it, ``truncated``, ``logps``: the sampler's log-probs, None for guided
    rows, whose opening the sampler did not choose, ``forced``: the opening's token count, and ``features``: the
    sampler's MEI features when ``features`` asks for them, None for guided rows, whose opening they would miss).
    """
    by_len: dict[int, list[int]] = {}
    for i, (op, _) in enumerate(openings):
        by_len.setdefault(len(op), []).append(i)
    rows: dict[int, list[dict[str, Any]]] = {}
    for length, members in sorted(by_len.items()):
        p = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - length)
        out = backend.generate([prompts[i] + openings[i][0] for i in members], p, seed=seed + 7919 * length,
                               **({"features": True} if features else {}))
        for r, ai in enumerate(out.prompt_index):
            i = members[ai]
            op, op_text = openings[i]
            logps = None if out.engine_logprobs is None or op else list(out.engine_logprobs[r])
            feats = None if out.engine_features is None or op else out.engine_features[r]
            rows.setdefault(i, []).append({
                "prompt_index": i, "prompt_ids": list(out.prompt_ids[r][: len(out.prompt_ids[r]) - len(op)]),
                "response_ids": op + list(out.response_ids[r]), "text": op_text + out.texts[r],
                "truncated": bool(out.truncated[r]), "logps": logps, "forced": len(op), "features": feats})
    return [rec for i in range(len(prompts)) for rec in rows.get(i, [])]


