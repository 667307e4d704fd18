"""A run's checkpoint as a standard Hugging Face model directory (``meshrl export model``).

A meshrl checkpoint (``RUN_DIR/checkpoints/step_N/model.safetensors``) holds weights only, and for a model
with tied input/output embeddings (the tiny models, SmolLM2) it stores the shared matrix once, so it is not
a model directory. :func:`export_model` rebuilds the policy exactly as ``meshrl eval`` does (the run's
``config.yaml`` and the checkpoint through :func:`meshrl.trainer.load_policy`) and writes it with
transformers' own ``save_pretrained``, which handles the tie: ``config.json``, ``model.safetensors``,
``generation_config.json`` (the run's sampling settings), the tokenizer with its chat template, and
``meshrl.json`` (run, step, recipe, held-out figures). A LoRA run is written merged, or with
``adapter=True`` as a peft adapter directory.

Before the directory is moved into place it is loaded back with ``AutoModelForCausalLM`` /
``AutoTokenizer`` (and peft for an adapter) and its logits on a probe prompt are compared with the
policy's, so an export that would not reproduce the checkpoint fails instead of being written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrl import __version__
from meshrl.export.args import add_out
from meshrl.jsonl import read_jsonl
from meshrl.models.loading import load_model
from meshrl.models.lora import has_lora
from meshrl.models.prompts import encode_prompt
from meshrl.models.smollm import CACHE_NAME, ensure_smollm2
from meshrl.models.tiny import TINY_PRESETS
from meshrl.rollout import SamplingParams
from meshrl.rollout.base import eos_ids
from meshrl.rollout.hf import generation_config
from meshrl.runs import check_out_dir, is_run_dir
from meshrl.runs.checkpoint import latest_checkpoint, read_pointer
from meshrl.trainer import RunConfig, load_config, load_policy

log = logging.getLogger("meshrl")

MODEL_HELP = """Write checkpoint STEP of RUN_DIR as a Hugging Face directory that AutoModelForCausalLM and
AutoTokenizer load offline: model.safetensors, config.json, generation_config.json (the run's sampling
settings), the tokenizer with its chat template, and meshrl.json (run, step, recipe, held-out figures).
LoRA runs are merged unless --adapter. The export is loaded back and checked against the checkpoint before
it is moved into place."""

INFO_FILE = "meshrl.json"
BASE_SUBDIR = "base_model"  # adapter exports of a base that exists only in memory (the tiny models)
SELECTORS = ("final", "best")
PROBE_TEXT = "What is 12 + 30? Answer with the number."
# Largest |logit difference| accepted between the reloaded export and the policy, relative to the largest
# |logit| (+1): merging LoRA into the weights reorders float sums, which moves logits by ~1e-6 relative in
# float32; a lost tie or a wrong weight moves them by order 1.
LOGIT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run and the rule that picked it (``final``, ``best`` or ``step``)."""

    path: Path
    step: int
    rule: str


def run_checkpoints(run_dir: Path) -> dict[int, Path]:
    """``{step: directory}`` of the complete checkpoints in ``run_dir/checkpoints`` (``step_N`` with a
    ``state.json``; the hidden temporary directories of a checkpoint being written are not listed, nor a ``step_N``
    that is a symbolic link: it leads outside the run, and meshrl never follows it)."""
    root = run_dir / "checkpoints"
    found = {}
    for path in root.glob("step_*") if root.is_dir() else ():
        digits = path.name.removeprefix("step_")
        if digits.isdigit() and not path.is_symlink() and (path / "state.json").is_file():
            found[int(digits)] = path
    return dict(sorted(found.items()))


def _linked_step(run_dir: Path, step: int) -> str:
    """``"; checkpoints/step_N is a symbolic link (to X), not followed"`` when it is one, else ``""``."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    return f"; {path} is a symbolic link (to {os.readlink(path)}), not followed" if path.is_symlink() else ""


def _warn_newer_links(run_dir: Path, step: int) -> None:
    """Log each ``step_N`` newer than ``step`` that is a symbolic link, unless ``latest`` names it (then
    :func:`latest_checkpoint` has said so): the final checkpoint exported is the run's own, not the link."""
    pointer = read_pointer(run_dir)
    named = pointer.name if pointer is not None and pointer.is_symlink() else None
    for link in sorted((run_dir / "checkpoints").glob("step_*")):
        digits = link.name.removeprefix("step_")
        if link.is_symlink() and link.name != named and digits.isdigit() and int(digits) > step:
            log.warning("%s is a symbolic link (to %s), not followed; exporting step_%06d", link,
                        os.readlink(link), step)


def _kept(found: dict[int, Path]) -> str:
    return ", ".join(str(s) for s in found) if found else "none"


def select_checkpoint(run_dir: Path, which: str | int) -> Checkpoint:
    """The checkpoint named by ``which``: ``final`` (the last one written), ``best`` (the step that the
    run's ``summary.json`` names best by its selection metric) or a step number."""
    found = run_checkpoints(run_dir)
    if not found:
        links = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_symlink())
        linked = f"; {', '.join(links)}: symbolic link(s), not followed" if links else ""
        raise ValueError(f"run {run_dir} has no checkpoint yet (checkpoints/step_N){linked}")
    if which == "final":
        latest = latest_checkpoint(run_dir)
        if latest is None:  # no pointer: the highest complete step is the last one written
            step = max(found)
            _warn_newer_links(run_dir, step)
            return Checkpoint(found[step], step, "final")
        step = next((s for s, p in found.items() if p.name == latest.name), None)
        if step is None:
            raise ValueError(f"run {run_dir}: checkpoints/latest names {latest.name}, which is not a step_N "
                             f"checkpoint (kept: {_kept(found)})")
        _warn_newer_links(run_dir, step)
        return Checkpoint(latest, step, "final")
    if which == "best":
        return _best_checkpoint(run_dir, found)
    step = _as_step(which)
    if step not in found:
        raise ValueError(f"run {run_dir} has no checkpoint for step {step} (kept: {_kept(found)})"
                         f"{_linked_step(run_dir, step)}")
    return Checkpoint(found[step], step, "step")


def _as_step(which: str | int) -> int:
    text = str(which)
    if not text.isdigit():
        raise ValueError(f"--step must be a step number, 'final' or 'best'; got {which!r}")
    return int(text)


def _best_checkpoint(run_dir: Path, found: dict[int, Path]) -> Checkpoint:
    summary = read_summary(run_dir)
    if summary is None:
        raise ValueError(f"--step best needs {run_dir / 'summary.json'}, written by runs that evaluate on a "
                         "held-out split (train with --set eval.every=E)")
    best = summary.get("best")
    step = best.get("step") if isinstance(best, dict) else None
    if not isinstance(step, int):
        raise ValueError(f"{run_dir / 'summary.json'}: 'best' has no integer 'step'")
    if step not in found:
        metric = summary.get("selection_metric", "?")
        raise ValueError(f"summary.json names step {step} best by {metric} (={best.get(metric)}), but its "
                         f"checkpoint was not kept (kept: {_kept(found)}); set checkpoint.every to divide "
                         "eval.every and raise checkpoint.keep_last to keep it")
    return Checkpoint(found[step], step, "best")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``summary.json`` of the run, None when the run did not evaluate during training."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def held_out_figures(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The held-out evaluation of ``step`` (its ``evals.jsonl`` row) and the run's checkpoint rule from
    ``summary.json``; None when the run has neither."""
    path = run_dir / "evals.jsonl"
    try:
        rows = read_jsonl(path) if path.is_file() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} has a line that is not JSON: {e}") from e
    summary = read_summary(run_dir)
    if not rows and summary is None:
        return None
    at_step = next((r for r in reversed(rows) if r.get("step") == step), None)  # resumed runs: last row wins
    out: dict[str, Any] = {"this_step": at_step}
    if summary is not None:
        out.update({k: summary.get(k) for k in ("selection_metric", "rule", "best", "final")})
    return out


def base_model_dir(spec: str) -> Path | None:
    """The directory that holds the run's base model (None for the tiny models, built in memory); a clear
    error when it cannot be found."""
    if spec in TINY_PRESETS:
        return None
    if spec == CACHE_NAME:
        try:
            return ensure_smollm2()
        except (ImportError, FileNotFoundError) as e:
            raise ValueError(f"the run's base model {spec} cannot be found: {e}") from e
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"the run's base model {spec!r} (config.yaml 'model') cannot be found: it is neither "
                         f"{', '.join([*TINY_PRESETS, CACHE_NAME])} nor an existing directory")
    return path.resolve()


def export_generation_config(cfg: RunConfig, model, tokenizer):
    """The run's rollout sampling (temperature, top-p, max new tokens) as a ``GenerationConfig``, with
    everything else that reshapes the distribution pinned neutral (transformers' default top_k=50 among
    them), so that ``generate()`` samples the distribution the policy was trained on."""
    ro = cfg.rollout
    params = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p)
    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    gen = generation_config(params, eos if len(eos) > 1 else eos[0], pad)
    gen.bos_token_id = tokenizer.bos_token_id
    return gen


def probe_ids(tokenizer) -> list[int]:
    """A chat prompt and a few answer tokens: positions under the chat template and past it."""
    return encode_prompt(tokenizer, PROBE_TEXT) + tokenizer.encode("42", add_special_tokens=False)


@torch.no_grad()
def probe_logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def export_model(run_dir: str | Path, out: str | Path, *, which: str | int = "final",
                 adapter: bool = False) -> dict[str, Any]:
    """Write checkpoint ``which`` of ``run_dir`` to the new directory ``out``; return ``meshrl.json``'s
    content. ``adapter=True`` (LoRA runs only) writes the peft adapter instead of merged weights."""
    run_dir, out = Path(run_dir), check_out_dir(out)
    if not is_run_dir(run_dir):
        raise ValueError(f"{run_dir} is not a meshrl run directory (config.yaml and checkpoints/)")
    if out.exists():
        raise ValueError(f"output directory {out} already exists; remove it or choose another --out")
    cfg = load_config(run_dir / "config.yaml")
    lora = cfg.train.lora_r > 0
    if adapter and not lora:
        raise ValueError(f"--adapter needs a LoRA run (train.lora_r > 0); {run_dir} trained all weights")
    chosen = select_checkpoint(run_dir, which)
    base_dir = base_model_dir(cfg.model)
    model, tokenizer, _ = load_policy(str(chosen.path), dtype=cfg.train.dtype)
    ids = probe_ids(tokenizer)
    expected = probe_logits(model, ids)
    gen = export_generation_config(cfg, model, tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        local_base = None
        if adapter:
            base_dir, local_base = _write_adapter(model, cfg, tokenizer, gen, tmp, base_dir, final_out=out)
        else:
            plain = model.merge_and_unload() if has_lora(model) else model
            plain.generation_config = gen
            plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        diff = verify_export(tmp, ids, expected, tokenizer, adapter_base=local_base)
        info = export_info(cfg, run_dir, chosen, adapter=adapter, base_dir=base_dir, probe_diff=diff,
                           probe_tokens=len(ids))
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1))
        if out.exists():  # appeared while we were writing: never replace someone's directory
            raise ValueError(f"output directory {out} appeared during the export; nothing was written there")
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return info


def _write_adapter(model, cfg: RunConfig, tokenizer, gen, tmp: Path, base_dir: Path | None,
                   final_out: Path) -> tuple[Path, Path]:
    """The peft adapter (``adapter_config.json``, ``adapter_model.safetensors``) naming the base's directory;
    a base that exists only in memory (tiny) is written to ``BASE_SUBDIR`` first. Returns the directory the
    adapter names and where that base is while the export is still in ``tmp``."""
    named, local = base_dir, base_dir
    if base_dir is None:
        named, local = final_out.resolve() / BASE_SUBDIR, tmp / BASE_SUBDIR
        _write_tiny_base(model, cfg, tokenizer, local)
    for peft_cfg in model.peft_config.values():
        peft_cfg.base_model_name_or_path = str(named)
    with warnings.catch_warnings():
        # peft looks for the base's config at `named` to see whether the vocabulary changed; a tiny base is
        # not there until the export is moved into place (the run never resizes the vocabulary).
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(tmp)
    gen.save_pretrained(tmp)
    return named, local


def _write_tiny_base(model, cfg: RunConfig, tokenizer, target: Path) -> None:
    """The frozen base weights under the adapter, as a model directory of their own."""
    base, _ = load_model(cfg.model, dtype=cfg.train.dtype, seed=cfg.seed)
    # peft keys are base_model.model.<hf key>, with ".base_layer" inside adapted layers.
    state = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
             for k, v in model.state_dict().items() if "lora_" not in k}
    base.load_state_dict(state, strict=True)
    base.save_pretrained(target)
    tokenizer.save_pretrained(target)


def verify_export(path: Path, ids: list[int], expected: torch.Tensor, tokenizer, *,
                  adapter_base: Path | None = None) -> float:
    """Load ``path`` as transformers (and peft) would and check that it reproduces the policy: the same
    prompt ids from its tokenizer and the same logits on them. Returns the largest |logit difference|."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded_tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if probe_ids(loaded_tok) != ids:
        raise ValueError(f"the exported tokenizer in {path} encodes the probe prompt differently from the run's")
    if adapter_base is None:
        loaded = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(str(adapter_base), local_files_only=True)
        loaded = PeftModel.from_pretrained(base, str(path))
    got = probe_logits(loaded.eval(), ids)
    diff = float((got - expected).abs().max())
    dtype = next(loaded.parameters()).dtype
    limit = LOGIT_RTOL.get(dtype, 3e-2) * (1.0 + float(expected.abs().max()))
    if not diff <= limit:
        raise ValueError(f"the exported model in {path} does not reproduce the checkpoint: max |logit "
                           f"difference| {diff:.3g} > {limit:.3g} on the probe prompt")
    return diff


def export_info(cfg: RunConfig, run_dir: Path, chosen: Checkpoint, *, adapter: bool, base_dir: Path | None,
                probe_diff: float, probe_tokens: int) -> dict[str, Any]:
    """``meshrl.json``: where the weights come from and how they were trained."""
    lora = cfg.train.lora_r > 0
    info: dict[str, Any] = {
        "meshrl_version": __version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": str(run_dir.resolve()),
        "checkpoint": chosen.path.name,
        "step": chosen.step,
        "selected_by": chosen.rule,
        "format": "peft_adapter" if adapter else ("merged_lora" if lora else "full"),
        "base_model": cfg.model,
        "recipe": cfg.recipe,
        "resolved_recipe": cfg.resolved_recipe().to_dict(),
        "task": cfg.task,
        "seed": cfg.seed,
        "lora": {"r": cfg.train.lora_r, "alpha": cfg.train.lora_alpha} if lora else None,
        "sampling": {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                     "max_new_tokens": cfg.rollout.max_new_tokens},
        "held_out": held_out_figures(run_dir, chosen.step),
        "verified": {"probe_tokens": probe_tokens, "max_abs_logit_diff": probe_diff},
    }
    if cfg.mesh_enabled:
        info["mesh"] = cfg.to_dict()["mesh"]
    if adapter:
        info["adapter_base_model_dir"] = str(base_dir)
    return info


def add_export_parser(export_subparsers: argparse._SubParsersAction) -> None:
    """Add ``model`` to the subcommands of ``meshrl export`` (sets ``func``)."""
    p = export_subparsers.add_parser("model", help="a run checkpoint as a Hugging Face model directory",
                                     description=MODEL_HELP)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a meshrl training run directory")
    p.add_argument("--step", default="final", metavar="N|best|final",
                   help="checkpoint: a step number, best (summary.json's checkpoint rule) or final "
                        "(the last checkpoint; default)")
    add_out(p, help="new directory to write (must not exist)")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write the peft adapter directory instead of merged weights")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    info = export_model(args.run_dir, args.out, which=args.step, adapter=args.adapter)
    print(json.dumps({"out": str(args.out), "step": info["step"], "selected_by": info["selected_by"],
                      "format": info["format"]}, indent=1))
    return 0
