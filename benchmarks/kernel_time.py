"""Time the diagnostics on a ~1M-parameter tiny Llama: the exact coupling kernel and MEI's overhead.

Measures (median over ``--repeats`` runs after one warm-up):

- ``exact kernel``: ``fisher_scores`` (exact per-rollout scores, ``loop`` and ``vmap``) +
  ``coupling_kernel`` + ``epsilon_partition`` for one query of G rollouts. Target: <= 2 s for G=16,
  responses of 32 tokens.
- ``sketched kernel``: the same with a count sketch of the scores (``--sketch-dim``).
- ``MEI overhead``: ``bias_features`` + ``mei_metrics`` (and ``head_gram`` exact / sketched) from the
  logits (and final hidden states) of the batch, against one plain forward + backward of the same batch
  (the step the trainer runs anyway); printed as a ratio.

Usage: ``python benchmarks/kernel_time.py [--G 16] [--resp-len 32] [--layers 4] [--d 128]
[--vocab 100] [--device cpu] [--threads N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshrl.cpu import cpu_info, describe
from meshrl.diagnostics import (
    bias_features,
    coupling_kernel,
    epsilon_partition,
    fisher_scores,
    head_gram,
    mei_metrics,
)


def build(args: argparse.Namespace) -> tuple[LlamaForCausalLM, int]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d, intermediate_size=4 * args.d, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(args.device).eval()
    return model, sum(p.numel() for p in model.parameters())


def make_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    L = args.prompt_len + args.resp_len
    ids = torch.randint(0, args.vocab, (args.G, L), generator=g)
    am = torch.ones(args.G, L, dtype=torch.long)
    rm = torch.zeros(args.G, L)
    rm[:, args.prompt_len :] = 1
    return ids.to(args.device), am.to(args.device), rm.to(args.device)


def timeit(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median wall time in seconds (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exact_kernel(model, ids, am, rm, method: str, sketch_dim: int | None = None) -> torch.Tensor:
    U = fisher_scores(model, ids, am, rm, method=method, sketch_dim=sketch_dim)
    return epsilon_partition(coupling_kernel(U)[1], eps=0.05)


def forward_backward(model, ids, am, rm) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=am).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(logp * rm[:, 1:]).sum()).backward()


def run(args: argparse.Namespace) -> dict[str, float]:
    model, n_params = build(args)
    ids, am, rm = make_batch(args)
    out: dict[str, float] = {"params": float(n_params), "G": float(args.G), "resp_len": float(args.resp_len)}
    r = args.repeats
    out["kernel_loop_s"] = timeit(lambda: exact_kernel(model, ids, am, rm, "loop"), r, args.device)
    out["kernel_vmap_s"] = timeit(lambda: exact_kernel(model, ids, am, rm, "vmap"), r, args.device)
    sketched = lambda: exact_kernel(model, ids, am, rm, "loop", args.sketch_dim)  # noqa: E731
    out["kernel_sketch_loop_s"] = timeit(sketched, r, args.device)
    out["fwd_bwd_s"] = timeit(lambda: forward_backward(model, ids, am, rm), r, args.device)
    with torch.no_grad():
        o = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    logits, hidden = o.logits[:, :-1], o.hidden_states[-1][:, :-1]
    tok, mask, qid = ids[:, 1:], rm[:, 1:], [0] * args.G
    out["mei_bias_s"] = timeit(lambda: mei_metrics(bias_features(logits, tok, mask), qid), r, args.device)
    out["mei_head_exact_s"] = timeit(
        lambda: mei_metrics(head_gram(logits, tok, hidden, mask), qid, feature="head", is_gram=True), r, args.device
    )
    out["mei_head_sketch_s"] = timeit(
        lambda: mei_metrics(head_gram(logits, tok, hidden, mask, proj_dim=args.sketch_dim), qid, is_gram=True),
        r, args.device,
    )
    for k in ("bias", "head_exact", "head_sketch"):
        out[f"ratio_mei_{k}_vs_fwd_bwd"] = out[f"mei_{k}_s"] / out["fwd_bwd_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--resp-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--sketch-dim", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = cpu_info()
    if not args.json:
        print(describe(info))
    out = run(args)
    if args.json:
        print(json.dumps({**out, "cpu": info}))
        return
    print(f"tiny Llama: {int(out['params']):,} parameters ({args.layers} layers, d={args.d}, vocab={args.vocab}); "
          f"G={args.G}, prompt {args.prompt_len} + response {args.resp_len} tokens; device {args.device}, "
          f"{torch.get_num_threads()} threads")
    for k, v in out.items():
        if k not in ("params", "G", "resp_len"):
            print(f"  {k:32s} {v:10.4f}" + ("" if k.startswith("ratio") else " s"))
    print(f"  exact kernel target <= 2 s: {'met' if out['kernel_loop_s'] <= 2.0 else 'MISSED'} (loop)")


if __name__ == "__main__":
    main()
