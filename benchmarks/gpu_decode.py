"""The native decoder on one device: the dynamic loop against the static decoder, tokens/s and memory-bandwidth use.

For each shape (gpu_check.py's Qwen2.5-shaped models with random weights) and each decoder (``dynamic``: the loop
with per-step shapes; ``static``: :mod:`meshrl.rollout.static_decode`, its step replayed as a CUDA graph on a GPU,
eagerly on a CPU), ``--rows`` rows (default 64, one prompt each) decode with ``ignore_eos`` under bf16 autocast:

* **decode step time**: ``(t(T2) - t(T1)) / (T2 - T1)`` from two generate calls of T1 and T2 new tokens, which
  cancels the prefill and the per-call set-up (graph capture included: each call is timed after an untimed one of
  the same shape, so the static decoder's buffers and graphs exist);
* **tokens/s**: rows x T2 / t(T2), the whole call;
* **bandwidth use**: the bytes a step must read at least, the sampler's weights in bf16 (every matrix, the head
  included) plus the KV cache at the mean length of the T1..T2 steps, over the step time, over the device's peak
  bandwidth (``--peak-gbs``; default from :data:`PEAK_GBS` by device name, else a measured device-to-device copy);
  the copy's own rate is reported beside it;
* **bit for bit**: the static decoder's tokens and log-probs with its graphs against the same decoder eager on the
  same device, seed and rows (must be equal), and the dynamic loop's tokens (equal but for float near-ties);
* peak memory per decoder (CUDA).

    python benchmarks/gpu_decode.py                       # on the GPU machine (gpu_check.sh runs it first)
    python benchmarks/gpu_decode.py --dry-run             # CPU, tiny shape: what CI runs
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SHAPES, Memory, build_model_dir, sync  # noqa: E402

from meshrl.cpu import cpu_info, describe  # noqa: E402

#: peak memory bandwidth in GB/s (10^9 B/s) by a substring of torch.cuda.get_device_name: the vendors' data sheets.
PEAK_GBS: dict[str, float] = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H100": 3350.0,
                              "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100": 1935.0, "L4": 300.0}


def peak_gbs(name: str | None) -> float | None:
    """The data-sheet bandwidth of the device called ``name`` (first matching key of :data:`PEAK_GBS`)."""
    for key, value in PEAK_GBS.items():
        if name and key in name:
            return value
    return None


def copy_gbs(device: torch.device, mib: int = 512, repeats: int = 5) -> float:
    """Measured device-to-device copy rate in GB/s (bytes read + written), the best of ``repeats``."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_bf16(model: torch.nn.Module) -> int:
    """Bytes of the sampler's matrices in bf16: every 2-D weight but the input embedding (a lookup of a few rows),
    the head counted once even when tied."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen = {id(emb)} - {id(head)}
    return sum(2 * p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in seen)


def kv_bytes(config: Any, rows: int, columns: float, itemsize: int) -> float:
    """Bytes of keys and values a step reads over ``columns`` cached positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2.0 * config.num_hidden_layers * rows * kv_heads * head_dim * columns * itemsize


def timed_generate(backend, prompts: list[list[int]], new_tokens: int, device: torch.device,
                   seed: int = 0) -> tuple[float, Any]:
    from meshrl.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    backend.generate(prompts, params, seed=seed)  # untimed: the same shape's buffers and graphs exist after it
    sync(device)
    t0 = time.perf_counter()
    out = backend.generate(prompts, params, seed=seed)
    sync(device)
    return time.perf_counter() - t0, out


def measure(model, tok, decoder: str, prompts: list[list[int]], args, device: torch.device) -> dict[str, Any]:
    from meshrl.rollout.native import NativeDecodeBackend

    mem = Memory(device)
    mem.reset()
    kind = "static" if decoder.startswith("static") else "dynamic"
    backend = NativeDecodeBackend(model, tok, workers=1, decoder=kind,
                                  autocast="bfloat16" if args.bf16 else None, prepack=False)
    if decoder == "static_eager":
        backend.capture_graphs = False
    t1, _ = timed_generate(backend, prompts, args.t1, device)
    t2, out = timed_generate(backend, prompts, args.t2, device)
    step_s = (t2 - t1) / (args.t2 - args.t1)
    rows = len(prompts)
    prompt_len = max(len(p) for p in prompts)
    mean_columns = prompt_len + (args.t1 + args.t2) / 2
    kept = getattr(backend, "_static", None)  # the cache's dtype: float32 keys leave the rotation under autocast
    cache_item = kept.k_full[0].element_size() if kept is not None and kept.k_full else 4
    floor = weight_bytes_bf16(model) + kv_bytes(model.config, rows, mean_columns, cache_item)
    res = {"decoder": decoder, "rows": rows, "t1": args.t1, "t2": args.t2, "call_s": t2,
           "tokens_per_s": rows * args.t2 / t2, "decode_step_ms": 1e3 * step_s, "bytes_per_step_floor": floor,
           "achieved_gbs": floor / step_s / 1e9 if step_s > 0 else None, **mem.peak()}
    backend.close()
    return {**res, "_out": out}


def run_shape(shape: str, args, device: torch.device, peak: float | None) -> dict[str, Any]:
    from meshrl.models import load_model

    tmp = Path(tempfile.mkdtemp(prefix=f"meshrl-gpu-decode-{shape}-"))
    model, tok = load_model(str(build_model_dir(shape, tmp / "model")), dtype="float32")
    model = model.to(device).eval()
    prompts = [tok.encode(f"Repeat: {i} {i * 7}", add_special_tokens=False) for i in range(args.rows)]
    decoders = ["dynamic", "static_eager", "static"] if device.type == "cuda" else ["dynamic", "static_eager"]
    result: dict[str, Any] = {"shape": shape, "weight_bytes_bf16": weight_bytes_bf16(model)}
    outs = {}
    for name in decoders:
        try:
            part = measure(model, tok, name, prompts, args, device)
        except Exception as e:  # one decoder failing must not lose the others' figures
            logging.getLogger("meshrl").exception("%s on %s failed", name, shape)
            result[name] = {"failed": f"{type(e).__name__}: {e}"}
            continue
        outs[name] = part.pop("_out")
        if peak and part["achieved_gbs"] is not None:
            part["bandwidth_use"] = part["achieved_gbs"] / peak
        result[name] = part
    if "static" in outs and "static_eager" in outs:
        a, b = outs["static"], outs["static_eager"]
        result["graph_equals_eager"] = (a.response_ids == b.response_ids
                                        and all(list(x) == list(y) for x, y in zip(a.engine_logprobs,
                                                                                    b.engine_logprobs, strict=True)))
    ref = outs.get("static", outs.get("static_eager"))
    if ref is not None and "dynamic" in outs:
        same = sum(x == y for x, y in zip(ref.response_ids, outs["dynamic"].response_ids, strict=True))
        result["rows_equal_to_dynamic"] = f"{same}/{len(prompts)}"
    return result


def report(r: dict[str, Any]) -> None:
    print(f"\n== {r['shape']} (bf16 weights read per step: {r['weight_bytes_bf16'] / 2**20:.0f} MiB)")
    for name in ("dynamic", "static_eager", "static"):
        s = r.get(name)
        if s is None:
            continue
        if "failed" in s:
            print(f"{name:<13} FAILED {s['failed']}")
            continue
        use = f"{100 * s['bandwidth_use']:.1f}% of peak" if s.get("bandwidth_use") is not None else "n/a"
        mem = f"{s['peak_allocated_gib']:.2f} GiB" if s.get("peak_allocated_gib") is not None else "n/a"
        print(f"{name:<13} {s['tokens_per_s']:>9.0f} tokens/s  step {s['decode_step_ms']:.2f} ms  "
              f"bandwidth {use}  peak memory {mem}")
    for key in ("graph_equals_eager", "rows_equal_to_dynamic"):
        if key in r:
            print(f"{key}: {r[key]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=list(SHAPES),
                    help="repeatable; default qwen2.5-0.5b and qwen2.5-1.5b")
    ap.add_argument("--dry-run", action="store_true", help="CPU, shape tiny-qwen, 8 rows, 4 and 12 tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--t1", type=int, default=32, help="new tokens of the shorter call")
    ap.add_argument("--t2", type=int, default=160, help="new tokens of the longer call")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--peak-gbs", type=float, default=None, help="peak bandwidth, GB/s (default: by device name)")
    ap.add_argument("--json", type=Path, default=Path("runs/gpu_decode.json"))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.rows, args.t1, args.t2 = "cpu", 8, 4, 12
        args.shape = args.shape or ["tiny-qwen"]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: torch sees no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    logging.getLogger("meshrl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    measured = copy_gbs(device) if device.type == "cuda" else None
    peak = args.peak_gbs or peak_gbs(name) or measured
    env = {"torch": torch.__version__, "device": args.device, "gpu": name, "peak_gbs": peak,
           "copy_gbs_measured": measured, "rows": args.rows, "t1": args.t1, "t2": args.t2, "bf16_autocast": args.bf16,
           "date": time.strftime("%Y-%m-%d"), "host_cpu": cpu_info()}
    print(describe(env["host_cpu"]))
    print(json.dumps(env))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shape or ["qwen2.5-0.5b", "qwen2.5-1.5b"]:
        results.append(run_shape(shape, args, device, peak))
        report(results[-1])
        args.json.write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"\nwrote {args.json}")
    bad = [r["shape"] for r in results if r.get("graph_equals_eager") is False
           or any("failed" in r.get(k, {}) for k in ("dynamic", "static_eager", "static"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
