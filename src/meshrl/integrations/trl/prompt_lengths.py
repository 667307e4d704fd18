"""Which rows of a Mesh dataset fit the model: every conditioned prompt plus ``max_completion_length`` must stay
within the model's positions, as in meshrl's own trainer (``meshrl.trainer.PromptBudget``).

A coach prefix can push a prompt past them: TRL would then generate and train on positions the model has no
embedding for, and on a 200,000-character prefix spend minutes and gigabytes tokenizing and attending over it.
The rows are measured once, before training, and cheaply: a rendered prompt longer than
``PROBE_CHARS_PER_POSITION`` characters per position is tokenized from its head only. Rows that do not fit are
dropped with a warning naming them and counted (``skipped/long_prompts`` in the logs).
"""

from __future__ import annotations

import logging
from typing import Any

from meshrl.mesh import query_key
from meshrl.trainer import PromptBudget, context_limit, encode_within_limit

log = logging.getLogger("meshrl")


def rendered_prompt(trainer, prompt: Any) -> str:
    """The text TRL tokenizes for ``prompt``: a plain string as is, messages through the chat template (an
    assistant message last is continued, as ``MeshGRPOTrainer._tokenize_prompts`` renders it)."""
    if isinstance(prompt, str):
        return prompt
    last = bool(prompt) and prompt[-1].get("role") == "assistant"
    return trainer.processing_class.apply_chat_template(
        conversation=prompt, chat_template=trainer.chat_template, add_generation_prompt=not last,
        continue_final_message=last, tokenize=False, **trainer.chat_template_kwargs)


def prompt_tokens(trainer, prompt: Any, limit: int | None) -> int:
    """Token count of ``prompt``, or a lower bound already past ``limit`` (bounded work on a huge prompt)."""
    def encode(tokenizer, text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return len(encode_within_limit(encode, trainer._tokenizer, rendered_prompt(trainer, prompt), limit))


def fitting_rows(trainer, dataset) -> tuple[list[int], dict[str, int]]:
    """(indices of the rows whose every prompt fits, ``{query id: prompt tokens}`` of those that do not).
    ``ValueError`` when ``max_completion_length`` leaves no room or no row fits."""
    mesh = trainer.mesh
    limit = context_limit(trainer.model, trainer._tokenizer)
    budget = PromptBudget(limit, trainer.max_completion_length, setting="GRPOConfig.max_completion_length")
    if limit is None:
        return list(range(len(dataset))), {}
    keep = []
    for i, row in enumerate(dataset):
        qid = str(row.get("query_id", i))
        if "prompt" not in row:
            raise ValueError(f"train_dataset row {qid} has no 'prompt' column (TRL's GRPOTrainer reads it)")
        prefixes = trainer.mesh_table[query_key(row[mesh.problem_column])][:mesh.m]
        prompts = [row["prompt"], *(mesh.conditioned_prompt(row["prompt"], p) for p in prefixes)]
        if all(budget.fits(qid, prompt_tokens(trainer, p, limit)) for p in prompts):
            keep.append(i)
    if not keep:
        raise ValueError(f"every train_dataset row's prompt is too long for the model ({limit} positions with "
                         f"GRPOConfig.max_completion_length={trainer.max_completion_length}; the longest coach "
                         f"prefixes included): shorten the prefixes or lower max_completion_length")
    if budget.too_long:
        log.warning("MeshGRPOTrainer: skipped %d of %d train_dataset rows whose prompt (with a coach prefix) does "
                    "not fit the model's %d positions with max_completion_length=%d (first: %s)",
                    len(budget.too_long), len(dataset), limit, trainer.max_completion_length,
                    ", ".join(list(budget.too_long)[:5]))
    return keep, dict(budget.too_long)


def subset(dataset, indices: list[int]):
    """``dataset`` restricted to ``indices`` (``datasets.Dataset.select``, else a torch ``Subset``)."""
    if len(indices) == len(dataset):
        return dataset
    if hasattr(dataset, "select"):
        return dataset.select(indices)
    from torch.utils.data import Subset

    return Subset(dataset, indices)
