"""Every trainer path on a device: a few steps of ``meshrl train`` per case, on the tiny model, one line per case.

A CPU run of the test suite cannot see a tensor left on the CPU while the policy is on a GPU (everything is on the
CPU there). This script runs the recipes, Mesh, MEI, the reference model, evaluation, the rollout backends, the
plug-ins and a tool-using task with ``train.device`` set to the device (and, in :data:`CHECKS`, the device's speed
path against the plain reference: log-probs and gradients), catches each case's error, and prints
``ok`` / ``FAIL`` with the error's last frame; the exit status is the number of failed cases. On a CPU
(``--device cpu``, tested in CI) every case must pass: a case that fails there is a broken case, not a device bug.

    python benchmarks/gpu_smoke.py --device cuda [--only grpo,mesh] [--json smoke.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

from meshrl.cpu import cpu_info, describe

BASE = ["model=tiny", "task=tiny:add", "steps=2", "seed=0", "log.progress=false", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=8", "checkpoint.every=1000"]

#: case name -> overrides on top of BASE (each case is a separate run).
CASES: dict[str, list[str]] = {
    "grpo": ["recipe=grpo"],
    "grpo_bf16": ["recipe=grpo", "train.autocast_bf16=true"],
    "grpo_mei": ["recipe=grpo", "diag.mei.every=1"],
    "grpo_kl": ["recipe=grpo_kl"],
    "grpo_js": ["recipe=grpo_js"],
    "dr_grpo": ["recipe=dr_grpo"],
    "dapo": ["recipe=dapo"],
    "gspo": ["recipe=gspo"],
    "cispo": ["recipe=cispo"],
    "ppo_epochs": ["recipe=grpo", "train.ppo_epochs=2", "train.mini_batches=2"],
    "no_share": ["recipe=grpo", "train.share_prompts=false"],
    "hf_backend": ["recipe=grpo", "rollout.backend=hf"],
    "static_decode": ["recipe=grpo", "rollout.backend=native", "rollout.decoder=static", "diag.mei.every=1"],
    "dynamic_decode": ["recipe=grpo", "rollout.backend=native", "rollout.decoder=dynamic"],
    "eval_every": ["recipe=grpo", "eval.every=1", "eval.limit=4"],
    "mesh": ["recipe=mesh", "mesh.m=2", "diag.mei.every=1"],
    "mesh_support": ["recipe=mesh", "mesh.m=2", "mesh.balance=support", "mesh.mu=0.1"],
    "cp_only": ["recipe=cp_only", "mesh.m=2"],
    "coach_guide": ["recipe=cp_only", "task=testbed:add", "rollout.max_new_tokens=22", "mesh.m=3",
                    "rollout.group_size=6", "plugins.coach_guide.enabled=true", "mesh.adv_unit=query"],
    "fork": ["recipe=grpo", "plugins.fork.enabled=true"],
    "clip_cov": ["recipe=grpo", "plugins.clip_cov.enabled=true"],
    "kl_cov": ["recipe=grpo", "plugins.kl_cov.enabled=true"],
    "entropy_adv": ["recipe=grpo", "plugins.entropy_adv.enabled=true"],
    "m2po": ["recipe=grpo", "plugins.m2po.enabled=true"],
    "future_kl": ["recipe=grpo", "plugins.future_kl.enabled=true"],
    "estr": ["recipe=grpo", "plugins.estr.enabled=true", "plugins.estr.tau=1.0"],
    "implicit_value": ["recipe=grpo", "plugins.implicit_value.enabled=true"],
    "rollout_corr": ["recipe=grpo", "plugins.rollout_corr.enabled=true"],
    "prompt_filter": ["recipe=grpo", "plugins.prompt_filter.enabled=true"],
    "tools": ["recipe=grpo", "task=env:calculator?max_turns=2&data=tiny:add"],
}


def check_speed_path(device: str) -> int:
    """The update's log-probs and gradients on the device's speed path (``cuda`` there) equal the plain reference's
    (``train.speed=plain``) to float tolerance, on one sampled batch; float32 and bf16 autocast. Returns the steps
    (0: a check, not a run)."""
    import torch

    from meshrl.testing import tiny_config
    from meshrl.trainer import Trainer

    for extra, tol in (((), 1e-4), (("train.autocast_bf16=true",), 3e-2)):
        with tempfile.TemporaryDirectory() as d:
            fast = Trainer(tiny_config(f"train.device={device}", *extra), Path(d) / "fast")
            plain = Trainer(tiny_config(f"train.device={device}", "train.speed=plain", *extra), Path(d) / "plain")
            try:
                data, _ = fast.plugins.sample(fast.sampler, 0, 0)
                got = [_logps_and_grads(t, data) for t in (fast, plain)]
            finally:
                fast.close()
                plain.close()
        (lp_a, g_a), (lp_b, g_b) = got
        worst = max(float((a - b).abs().max()) for a, b in zip(lp_a, lp_b, strict=True))
        if worst > tol:
            raise AssertionError(f"{fast.speed.name} vs plain {extra}: log-probs differ by {worst:.3g} > {tol}")
        for a, b in zip(g_a, g_b, strict=True):
            if not torch.allclose(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=tol):
                raise AssertionError(f"{fast.speed.name} vs plain {extra}: gradients differ by "
                                     f"{float((a - b).abs().max()):.3g}")
    return 0


def _logps_and_grads(trainer, data):
    fwd = trainer.forward
    logps = fwd.logps(trainer.model, data)
    trainer.model.zero_grad(set_to_none=True)
    for _, mb in fwd.micro_batches(list(range(len(data))), data):
        fwd.seq_logp(mb).sum().backward()
    return logps, [p.grad.detach().cpu().clone() for p in trainer.model.parameters()]


#: checks that are not a training run: name -> function(device) -> steps run
CHECKS = {"speed_path_grads": check_speed_path}


def run_case(name: str, overrides: list[str], device: str) -> dict:
    from meshrl.trainer import load_config, train

    t0 = time.perf_counter()
    try:
        if name in CHECKS:
            steps = CHECKS[name](device)
        else:
            cfg = load_config(overrides=[*BASE, *overrides, f"train.device={device}"])
            with tempfile.TemporaryDirectory() as d:
                records = list(train(cfg, Path(d) / "run"))
            steps = sum(1 for r in records if "step" in r)
        return {"case": name, "ok": True, "steps": steps, "s": round(time.perf_counter() - t0, 1)}
    except Exception as exc:  # noqa: BLE001 - every case reports, none stops the others
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return {"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400],
                "where": f"{frame.filename}:{frame.lineno}", "trace": traceback.format_exc()[-3000:],
                "s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    known = [*CASES, *CHECKS]
    names = [n for n in args.only.split(",") if n] or known
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    host_cpu = cpu_info()
    print(describe(host_cpu), flush=True)
    results = []
    for name in names:
        res = {**run_case(name, CASES.get(name, []), args.device), "host_cpu": host_cpu}
        results.append(res)
        ok = f"ok ({res['steps']} steps, {res['s']} s)" if res["ok"] else ""
        print(f"{name:16s} {ok or 'FAIL ' + res['error'] + ' at ' + res['where']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(f"\n== {r['case']}\n{r['trace']}")
    print(f"\n{len(results) - len(failed)}/{len(results)} cases ok on {args.device}")
    return len(failed)


if __name__ == "__main__":
    raise SystemExit(main())
