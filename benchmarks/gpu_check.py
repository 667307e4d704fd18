"""meshrl's trainer against TRL's ``GRPOTrainer`` on one GPU, on Qwen2.5-shaped models built from their config.

The GPU machine this is written for has no network and no room for model weights, so the models are the shapes
of Qwen2.5-0.5B and -1.5B with random weights (``Qwen2Config`` with the published sizes; attention, MLP and head
FLOPs are those of the real models) and a tokenizer of the same vocabulary size: the printable characters of
meshrl's ``tiny`` tokenizer first (so the ``tiny:repeat`` prompts encode the same way), then placeholder tokens up
to 151,936 that decode to ``<|xN|>``. A random model earns no reward, so every advantage is 0: meshrl runs with
``train.skip_zero_advantage=false`` so that its backward runs on every row as TRL's does, and both sides do the
whole work of a real step.

Both sides run the same GRPO step (throughput_vs_trl.py's table of matched settings) in bf16 autocast over fp32
weights (TRL's ``bf16=True``; meshrl's ``train.autocast_bf16`` and ``rollout.autocast_bf16``), one prompt group
per G rows, the whole batch in one forward, no gradient checkpointing, on the same initial weights and prompts.
Printed and written to ``--json`` per shape and side: tokens/s (prompt + completion tokens of a step over its
time), completion tokens/s, median step time, model FLOP utilisation, peak GPU memory (allocated and reserved,
``torch.cuda.max_memory_*`` after a reset per side) and, for meshrl, the MEI overhead (the same step with
``mei.every=1``, median step time against the plain one).

Model FLOP utilisation counts the matrix work a step must do, as in the PaLM paper's appendix B: 2·N FLOPs per
token for a forward (prompt prefill and each decoded token) and 6·N per token for the update's forward and
backward, with N the parameters that multiply (the input embedding is a lookup, so an untied one is left out),
over ``--peak-tflops`` (H200 SXM bf16 dense: 989). Attention's own FLOPs are left out (small at these lengths).
``train_mfu`` is the training phase's: 6·N per token of the step over the update phase's time alone.

meshrl's plain side also reports its phases (:class:`PhaseProbe`: rollout, old log-probs, update, weight sync; time
per step and, on CUDA, each phase's peak memory), and every side whether its peak would fit an 80 GB card
(``fits_80gb``: reserved memory <= 79 GiB, or an out-of-memory failure). The long shape of the GPU issue is
``--shape qwen2.5-1.5b --max-new-tokens 1024`` (a call of its own).

    bash benchmarks/gpu_check.sh                      # on the GPU machine (see that script)
    python benchmarks/gpu_check.py --dry-run          # CPU, a tiny Qwen2 shape: what CI runs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput_vs_trl import TASK, Side, check_prompts, make_timer_callback, trl_trainer  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402

#: Qwen2.5's published sizes (config.json of Qwen/Qwen2.5-0.5B and -1.5B); ``tiny-qwen`` is the CPU dry run's;
#: SmolLM2-135M and -360M (HuggingFaceTB's config.json, Llama architecture) for benchmarks/cost_growth.py. An entry's
#: ``architecture`` (default ``qwen2``) picks the config class; the rest are that config's fields.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny-qwen": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "smollm2-135m": dict(architecture="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "smollm2-360m": dict(architecture="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True),
}
#: Per architecture: the transformers config and model classes and the published fields the shapes share
#: (Qwen2.5: RoPE base 1e6, RMSNorm eps 1e-6; SmolLM2: 1e5 and 1e-5).
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=1e5, rms_norm_eps=1e-5)),
}
H200_BF16_DENSE_TFLOPS = 989.0
FITS_80GB_GIB = 79.0  # what PyTorch can reserve on an 80 GB H100, roughly (the driver and context keep the rest)


def build_tokenizer(vocab_size: int):
    """meshrl's character tokenizer (ids 0-99, same chat template) padded with placeholder tokens to
    ``vocab_size``, so that every id the model can sample decodes."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from meshrl.models.tiny import BOS, CHAT_TEMPLATE, EOS, PAD, UNK, char_vocab

    chars = char_vocab()
    vocab = {tok: i for i, tok in enumerate(chars)}
    vocab.update({f"<|x{i}|>": i for i in range(len(chars), vocab_size)})
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                  pad_token=PAD)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def shape_config(shape: str, tokenizer):
    """The transformers config of ``shape`` (random weights are built from it), special ids from ``tokenizer``."""
    import transformers

    fields = dict(SHAPES[shape])
    config_cls, _, shared = ARCHITECTURES[fields.pop("architecture", "qwen2")]
    return getattr(transformers, config_cls)(
        **fields, **shared, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def shape_model_class(shape: str):
    import transformers

    return getattr(transformers, ARCHITECTURES[SHAPES[shape].get("architecture", "qwen2")][1])


def build_model_dir(shape: str, out: Path, seed: int = 0, tokenizer=None) -> Path:
    """A Hugging Face directory with a randomly initialised model of ``shape`` (fp32) and its tokenizer:
    ``tokenizer`` if given (its vocabulary must fit the shape's), else :func:`build_tokenizer` of the shape's size."""
    tok = tokenizer if tokenizer is not None else build_tokenizer(SHAPES[shape]["vocab_size"])
    if len(tok) > SHAPES[shape]["vocab_size"]:
        raise ValueError(f"the tokenizer has {len(tok)} tokens, more than shape {shape}'s vocabulary "
                         f"({SHAPES[shape]['vocab_size']})")
    cfg = shape_config(shape, tok)
    torch.manual_seed(seed)
    model = shape_model_class(shape)(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def matmul_params(model: torch.nn.Module) -> int:
    """N of the FLOP count: every parameter but an untied input embedding (a lookup, not a product)."""
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if emb is head else total - emb.numel()


def step_flops(n_params: int, prompt_tokens: int, gen_tokens: int) -> float:
    """2N per prefilled and per decoded token, 6N per token of the update (forward + backward)."""
    return 2.0 * n_params * (prompt_tokens + gen_tokens) + 6.0 * n_params * (prompt_tokens + gen_tokens)


class Memory:
    """Peak GPU memory of one side (nothing on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> dict[str, float | None]:
        if not self.cuda:
            return {"peak_allocated_gib": None, "peak_reserved_gib": None}
        torch.cuda.synchronize()
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class PhaseProbe:
    """Per-phase time and peak memory of a meshrl ``Trainer``'s steps, by wrapping its methods: ``rollout``
    (sampling and rewards, ``plugins.sample``), ``old_logprobs`` (the no-grad forwards before the update,
    ``forward.logps``), ``update`` (each mini-batch's backward and optimiser step) and ``weight_sync``
    (``backend.sync_weights``). On CUDA each phase resets the peak-memory counter at its start and reads it at its
    end, so a phase's peak is its own (what was allocated before it included)."""

    PHASES = {"rollout": ("plugins", "sample"), "old_logprobs": ("forward", "logps"),
              "update": (None, "mini_batch_update"), "weight_sync": ("backend", "sync_weights")}

    def __init__(self, trainer, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.reset()
        for phase, (owner, name) in self.PHASES.items():
            obj = trainer if owner is None else getattr(trainer, owner)
            setattr(obj, name, self._wrap(phase, getattr(obj, name)))

    def reset(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.peak_gib: dict[str, float | None] = dict.fromkeys(self.PHASES)

    def _wrap(self, phase: str, fn):
        def timed(*a, **k):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    self.peak_gib[phase] = max(self.peak_gib[phase] or 0.0, peak)
                self.seconds[phase] += time.perf_counter() - t0

        return timed

    def summary(self, steps: int) -> dict[str, Any]:
        return {phase: {"s_per_step": self.seconds[phase] / max(steps, 1), "peak_allocated_gib": self.peak_gib[phase]}
                for phase in self.PHASES}


def meshrl_trainer(model_dir: Path, args, device: torch.device, run_dir: Path, *, mei: bool,
                   extra: tuple[str, ...] = ()):
    """meshrl's side of the comparison; ``extra``: further ``key=value`` settings (memory_twin.py's)."""
    from meshrl.trainer import Trainer, load_config

    p, g = args.prompts, args.group
    overrides = [
        f"model={model_dir}", f"task={TASK}", "recipe=grpo", "seed=0", "steps=1000000",
        f"rollout.prompts_per_step={p}", f"rollout.group_size={g}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.batch_size={p * g}",
        f"rollout.autocast_bf16={'true' if args.bf16 else 'false'}",
        f"optim.lr={args.lr}", "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.max_grad_norm=1.0",
        "train.ppo_epochs=1", "train.mini_batches=1", f"train.micro_batch_size={p * g}", "train.dtype=float32",
        f"train.autocast_bf16={'true' if args.bf16 else 'false'}", f"train.device={device}",
        "train.skip_zero_advantage=false", f"diag.mei.every={1 if mei else 0}", "log.progress=false",
        "checkpoint.every=1000000", *extra,
    ]
    return Trainer(load_config(overrides=overrides), run_dir)


def time_meshrl(trainer, side: Side, steps: int, device: torch.device, probe: PhaseProbe | None = None,
                warmup: int = 0) -> None:
    for i in range(steps):
        if probe is not None and i == warmup:
            probe.reset()  # the phases of the timed steps only
        sync(device)
        t0 = time.perf_counter()
        trainer.step()
        sync(device)
        side.seconds.append(time.perf_counter() - t0)
        data = trainer.last_data
        side.tokens.append(sum(len(a) + len(b) for a, b in zip(data.prompt_ids, data.response_ids, strict=True)))
        side.gen_tokens.append(sum(len(b) for b in data.response_ids))
        side.extra.setdefault("len/response_mean", []).append(side.gen_tokens[-1] / max(1, len(data.response_ids)))


def summarise(side: Side, warmup: int, n_params: int, prompt_tokens_per_step: float,
              peak_tflops: float | None) -> dict[str, Any]:
    s = side.summary(warmup)
    gen = s["gen_tokens_per_step"]
    flops = step_flops(n_params, prompt_tokens_per_step, gen)
    s["tflops_per_step"] = flops / 1e12
    s["mfu"] = (flops / s["step_s_median"]) / (peak_tflops * 1e12) if peak_tflops else None
    return s


def run_meshrl(model_dir: Path, args, device: torch.device, tmp: Path, n_params: int, mem: Memory,
               prompt_tokens: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mei in (False, True):
        name = "meshrl_mei" if mei else "meshrl"
        mem.reset()
        trainer = meshrl_trainer(model_dir, args, device, tmp / name, mei=mei)
        side = Side(name)
        probe = None if mei else PhaseProbe(trainer, device)
        try:
            time_meshrl(trainer, side, args.warmup + args.steps, device, probe, args.warmup)
        finally:
            trainer.close()
        out[name] = {**summarise(side, args.warmup, n_params, prompt_tokens, args.peak_tflops), **mem.peak()}
        if probe is not None:  # the phases reset the peak counter: the side's peak is the largest phase's
            phases = probe.summary(args.steps)
            out[name]["phases"] = phases
            peaks = [p["peak_allocated_gib"] for p in phases.values() if p["peak_allocated_gib"] is not None]
            if peaks:
                out[name]["peak_allocated_gib"] = max([*peaks, out[name]["peak_allocated_gib"] or 0.0])
            update_s = phases["update"]["s_per_step"]
            flops = 6.0 * n_params * out[name]["tokens_per_step"]  # 6N per trained token (PaLM, appendix B)
            out[name]["train_mfu"] = (flops / update_s / (args.peak_tflops * 1e12)
                                      if args.peak_tflops and update_s > 0 else None)
        del trainer
    out["mei_overhead"] = out["meshrl_mei"]["step_s_median"] / out["meshrl"]["step_s_median"] - 1.0
    return out


def run_trl(model_dir: Path, args, device: torch.device, tmp: Path, n_params: int, mem: Memory,
            prompt_tokens: float) -> dict[str, Any]:
    from meshrl.models import load_model
    from meshrl.tasks import load_task

    mem.reset()
    model, tok = load_model(str(model_dir), dtype="float32")
    model = model.to(device)
    side = Side("trl")
    trainer = trl_trainer(model, copy.deepcopy(tok), load_task(TASK, seed=0), args.prompts, args.group,
                          args.max_new_tokens, args.lr, args.warmup + args.steps, tmp / "trl", side,
                          [make_timer_callback(side)], use_cpu=device.type == "cpu", bf16=args.bf16)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    out = {**summarise(side, args.warmup, n_params, prompt_tokens, args.peak_tflops), **mem.peak()}
    del trainer, model
    return out


def run_shape(shape: str, args, device: torch.device) -> dict[str, Any]:
    from meshrl.models import load_model
    from meshrl.tasks import load_task

    tmp = Path(tempfile.mkdtemp(prefix=f"meshrl-gpu-check-{shape}-"))
    t0 = time.perf_counter()
    model_dir = build_model_dir(shape, tmp / "model")
    model, tok = load_model(str(model_dir), dtype="float32")
    n_params = matmul_params(model)
    prompt_len = check_prompts(tok, load_task(TASK, seed=0))
    del model
    prompt_tokens = float(prompt_len * args.prompts * args.group)
    result: dict[str, Any] = {"shape": shape, "matmul_params": n_params, "build_s": time.perf_counter() - t0,
                              "prompt_tokens_per_row_max": prompt_len}
    mem = Memory(device)
    for name, run in (("meshrl", run_meshrl), ("trl", run_trl)):
        if name == "trl" and args.no_trl:
            result["trl"] = {"skipped": "--no-trl"}
            continue
        try:
            part = run(model_dir, args, device, tmp, n_params, mem, prompt_tokens)
        except ImportError as e:  # TRL (or datasets) not installed where this runs: say so, keep the rest
            result[name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        except Exception as e:  # one side failing must not lose the other's figures
            logging.getLogger("meshrl").exception("%s on %s failed", name, shape)
            result[name] = {"failed": f"{type(e).__name__}: {e}"}
            continue
        result.update(part if name == "meshrl" else {"trl": part})
    for name in ("meshrl", "meshrl_mei", "trl"):  # an 80 GB card (H100) leaves about 79 GiB to PyTorch
        side = result.get(name, {})
        if side.get("peak_reserved_gib") is not None:
            side["fits_80gb"] = side["peak_reserved_gib"] <= FITS_80GB_GIB
        elif "out of memory" in str(side.get("failed", "")).lower():
            side["fits_80gb"] = False
    if "tokens_per_s" in result.get("meshrl", {}) and "tokens_per_s" in result.get("trl", {}):
        result["ratio_tokens_per_s"] = result["meshrl"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
    return result


def report(r: dict[str, Any]) -> None:
    print(f"\n== {r['shape']} ({r['matmul_params'] / 1e6:.1f}M matmul parameters)")
    for name in ("meshrl", "meshrl_mei", "trl"):
        s = r.get(name, {})
        if "tokens_per_s" not in s:
            print(f"{name:<11} {s}")
            continue
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a"
        mem = f"{s['peak_allocated_gib']:.2f} GiB" if s["peak_allocated_gib"] is not None else "n/a"
        print(f"{name:<11} tokens/s {s['tokens_per_s']:>9.0f}  gen tokens/s {s['gen_tokens_per_s']:>8.0f}  "
              f"step {s['step_s_median']:.3f} s  MFU {mfu}  peak memory {mem}")
    phases = r.get("meshrl", {}).get("phases")
    if phases:
        print("meshrl phases (s per step, peak GiB): " + ", ".join(
            f"{k} {v['s_per_step']:.3f}" + (f" / {v['peak_allocated_gib']:.2f}" if v["peak_allocated_gib"] else "")
            for k, v in phases.items()))
    if "mei_overhead" in r:
        print(f"MEI overhead (mei.every=1 vs 0, median step): {100 * r['mei_overhead']:+.1f}%")
    if "ratio_tokens_per_s" in r:
        print(f"meshrl / TRL tokens/s: {r['ratio_tokens_per_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=list(SHAPES),
                    help="repeatable; default qwen2.5-0.5b then qwen2.5-1.5b while --budget-s allows")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, shape tiny-qwen, 1 warm-up + 1 timed step, small batch: checks the script runs")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 (default: bf16 autocast)")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help=f"dense bf16 peak for MFU (default {H200_BF16_DENSE_TFLOPS} on CUDA, none on CPU)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start another default shape only while under half of this many seconds have passed")
    ap.add_argument("--json", type=Path, default=Path("runs/gpu_check.json"),
                    help="where the results go (default runs/gpu_check.json, git-ignored)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.prompts, args.group, args.max_new_tokens = "cpu", 2, 4, 8
        args.steps, args.warmup, args.shape = 1, 1, args.shape or ["tiny-qwen"]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --dry-run (or --device cpu) on a CPU", file=sys.stderr)
        return 2
    if args.peak_tflops is None and device.type == "cuda":
        args.peak_tflops = H200_BF16_DENSE_TFLOPS
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
           "steps": args.steps, "warmup": args.warmup, "bf16_autocast": args.bf16, "peak_tflops": args.peak_tflops,
           "host_cpu": cpu_info()}
    with contextlib.suppress(ImportError):
        import transformers

        env["transformers"] = transformers.__version__
    with contextlib.suppress(ImportError):
        import trl

        env["trl"] = trl.__version__
    print(describe(env["host_cpu"]))
    print(json.dumps(env))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    for i, shape in enumerate(args.shape or ["qwen2.5-0.5b", "qwen2.5-1.5b"]):
        if i and not args.shape and time.perf_counter() - start > args.budget_s / 2:
            print(f"skipping {shape}: {time.perf_counter() - start:.0f} s of the {args.budget_s:.0f} s budget spent")
            break
        results.append(run_shape(shape, args, device))
        report(results[-1])
        args.json.write_text(json.dumps({"env": env, "results": results}, indent=1))  # after each shape: kept
    print(f"\nwrote {args.json} ({time.perf_counter() - start:.0f} s)")
    failed = [f"{r['shape']}/{k}" for r in results for k in ("meshrl", "trl") if "failed" in r.get(k, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
