"""A tiny Llama-style causal LM and a character-level tokenizer, both built in-process.

They need no download and no file, so tests and the CPU demo run on a fresh machine. The weights come
from a seeded init (same seed -> identical weights); the model knows nothing until it is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# ChatML-like: every turn is "<s>ROLE\nCONTENT</s>\n"; the model ends its turn with eos (</s>).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyPreset:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int


TINY_PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256),
    "tiny:small": TinyPreset(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=512),
    "tiny:medium": TinyPreset(layers=6, hidden=256, heads=8, kv_heads=4, intermediate=1024),
}


def char_vocab() -> list[str]:
    """Special tokens first (ids 0-3), then printable ASCII (space..~) and newline: 100 entries."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    return list(SPECIAL_TOKENS) + chars


def build_char_tokenizer(*, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer with a chat template.

    A BPE model with no merges splits text into single characters; unknown characters map to <unk>.
    ``pad_is_eos=True`` mimics checkpoints such as SmolLM2 whose pad token is the eos token.
    """
    vocab = {tok: i for i, tok in enumerate(char_vocab())}
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    # Without a decoder, `tokenizers` would join the characters with spaces.
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=EOS if pad_is_eos else PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    return tok


def tiny_config(preset: str, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """Llama config for a preset, with token ids taken from the tokenizer and tied embeddings."""
    p = TINY_PRESETS[preset]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny(
    preset: str = "tiny", *, seed: int = 0, pad_is_eos: bool = False
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build a tiny model and its tokenizer; the weights depend only on ``preset`` and ``seed``."""
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; known: {sorted(TINY_PRESETS)}")
    tokenizer = build_char_tokenizer(pad_is_eos=pad_is_eos)
    config = tiny_config(preset, tokenizer)
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.eval()
    return model, tokenizer
