"""The native decoder's GEMMs at SmolLM2-135M's shapes: which kind is fastest on this CPU.

Times ``x @ W^T`` for ``--rows`` rows (a decode step's batch) against each of SmolLM2-135M's decode weights (fused
q|k|v, o, fused gate|up, down, the 49,152-token head) four ways: float32 ``F.linear``, bf16 ``F.linear`` (what bf16
autocast runs), float32 on a oneDNN-prepacked weight, and bf16 on a prepacked weight (only where oneDNN has bf16
kernels: :func:`meshrl.cpu.bf16_gemm_native`). Decides :func:`meshrl.models.llama_fast.prepacked_dtype`'s rule; see
benchmarks/README.md, "CPUs without native bf16". To see a CPU without AVX-512 on one that has it, run it under
PyTorch's and oneDNN's ISA caps (they pick the same kernels such a CPU gets, on this CPU's cores)::

    python benchmarks/decode_gemm.py --threads 1 --json runs/gemm_native.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/decode_gemm.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from meshrl.cpu import bf16_gemm_native, cpu_info, describe

#: (name, out features, in features) of SmolLM2-135M's decode GEMMs (hidden 576, 9 + 2 x 3 heads of 64, MLP 1536)
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576))


def median_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def kinds(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways to compute ``x @ w^T`` that this CPU can run."""
    wb, xb = w.bfloat16(), x.bfloat16()
    pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
    out = {"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(xb, wb),
           "fp32_prepacked": lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")}
    if bf16_gemm_native():
        pwb = torch.ops.mkldnn._reorder_linear_weight(wb, None)
        out["bf16_prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, pwb, None, "none", [], "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="rows per GEMM (a decode step's batch)")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per kind and shape (median reported)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.rows < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--rows, --reps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = cpu_info()
    print(f"{describe(info)}; load average {os.getloadavg()[0]:.2f}")
    rows = []
    with torch.inference_mode():
        for name, n_out, n_in in SHAPES:
            w, x = 0.05 * torch.randn(n_out, n_in), torch.randn(args.rows, n_in)
            times = {k: median_ms(fn, args.reps) for k, fn in kinds(w, x).items()}
            rows.append({"gemm": name, "shape": [n_out, n_in], **times})
            print(f"{name:8s} {n_out:6d}x{n_in:<5d} " + "  ".join(f"{k} {v:8.3f} ms" for k, v in times.items()))
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k not in ("gemm", "shape")}
    print("sum over one layer's GEMMs and the head: " + "  ".join(f"{k} {v:.2f} ms" for k, v in total.items()))
    if args.json:
        args.json.write_text(json.dumps({"cpu": info, "rows": args.rows, "threads": args.threads, "gemms": rows,
                                         "total_ms": total, "load_end": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
