"""benchmarks/cost_growth.py and growth_fit.py: the fits recover known coefficients, the dominance and extrapolation
logic, the figure is well-formed SVG, and a real two-point sweep on ``tiny`` (meshrl side) writes its JSON lines,
resumes without rerunning them, and records a point killed for time or memory instead of stopping."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cost_growth  # noqa: E402
from growth_fit import Fit, Measured, analyse, fit_poly, markdown, preferred, svg  # noqa: E402
from memory_vs_trl import SideRun, TreeSampler  # noqa: E402

XS = [4.0, 8.0, 16.0, 32.0, 64.0]


def test_fits_recover_known_coefficients():
    quad = fit_poly(XS, [0.7 + 0.05 * x + 0.002 * x * x for x in XS], 2)
    assert quad.coef == pytest.approx([0.7, 0.05, 0.002], rel=1e-9, abs=1e-12) and quad.rss < 1e-20
    lin = fit_poly([32, 64, 128, 256, 512, 1024], [1.5 + 0.004 * x for x in (32, 64, 128, 256, 512, 1024)], 1)
    assert lin.coef == pytest.approx([1.5, 0.004], rel=1e-9)
    # A line through noisy points: least squares, not interpolation (the mean residual is zero).
    noisy = fit_poly([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0], 1)
    assert noisy.coef == pytest.approx([0.5, 0.8]) and noisy.rss == pytest.approx(1.8)
    with pytest.raises(ValueError, match="at least 3 distinct x"):
        fit_poly([1, 1, 2], [1, 2, 3], 2)


def test_preferred_fit_and_term_shares():
    curved = [1 + 0.01 * x * x for x in XS]
    assert preferred(fit_poly(XS, curved, 1), fit_poly(XS, curved, 2)).kind == "quadratic"
    straight = [2 + 0.5 * x + (0.01 if k % 2 else -0.01) for k, x in enumerate(XS)]
    assert preferred(fit_poly(XS, straight, 1), fit_poly(XS, straight, 2)).kind == "linear"
    exact = [2 + 0.5 * x for x in XS]
    assert preferred(fit_poly(XS, exact, 1), fit_poly(XS, exact, 2)).kind == "linear"
    three = [1.0, 2.0, 9.0]  # three points: the quadratic fits exactly, which says nothing
    assert preferred(fit_poly([1, 2, 3], three, 1), fit_poly([1, 2, 3], three, 2)).kind == "linear"
    f = Fit([4.0, 1.0, 0.25], 0.0, 5)  # terms at x=4: 4, 4, 4; at x=16: 4, 16, 64
    assert f.shares(4) == pytest.approx([1 / 3] * 3)
    assert f.shares(16) == pytest.approx([4 / 84, 16 / 84, 64 / 84]) and f.dominant(16) == "quadratic"
    assert f.dominant(1) == "constant" and Fit([0.0, 2.0, 0.01], 0.0, 5).dominant(10) == "linear"


def test_reach_solves_the_fit_for_the_memory_limit():
    assert Fit([2.0, 0.5], 0, 5).reach(24) == pytest.approx(44.0)
    quad = Fit([1.0, 0.5, 0.01], 0, 5)
    x = quad.reach(24)
    assert quad(x) == pytest.approx(24) and 0 < x < 46  # the first crossing, before the linear part alone gets there
    assert Fit([30.0, 1.0], 0, 5).reach(24) == 0.0  # already past at x = 0
    assert Fit([2.0, -0.1], 0, 5).reach(24) is None  # falls: never
    assert Fit([2.0, 1.0, -0.1], 0, 5).reach(24) is None  # peaks at 4.5 GB: never


def _series() -> dict:
    meshrl = [Measured(x, f"{x:g}", "ok", 0.5 + 0.01 * x, 1.0 + 0.05 * x) for x in XS]
    trl = [Measured(x, f"{x:g}", "ok", 0.8 + 0.0005 * x * x, 2.0 + 0.002 * x * x) for x in XS[:4]]
    trl.append(Measured(64.0, "64", "oom"))
    return {"group": {"meshrl": meshrl, "trl": trl},
            "length": {"meshrl": [Measured(x, f"{x:g}", "ok", 1 + x / 100, 2 + x / 500) for x in (32, 64, 128)],
                       "trl": [Measured(32, "32", "timeout")]}}


def test_analysis_marks_where_each_side_reaches_the_limit():
    fits = analyse(_series(), 24.0)
    mem = fits["group"]["trl"]["peak_gb"]
    assert mem.best.kind == "quadratic" and mem.xs == XS[:4]  # the OOM point is left out of the fit
    assert mem.best.coef == pytest.approx([2.0, 0.0, 0.002], abs=1e-9)
    assert mem.reach_x == pytest.approx((22 / 0.002) ** 0.5)
    assert fits["group"]["meshrl"]["peak_gb"].reach_x == pytest.approx(460.0)
    assert fits["group"]["meshrl"]["time_s"].reach_x is None  # only memory is solved for the limit
    assert fits["length"]["trl"]["time_s"] is None  # nothing ran: no fit
    d = fits["group"]["trl"]["peak_gb"].as_dict()
    assert d["preferred"] == "quadratic" and d["dominant"]["4"] == "constant" and d["dominant"]["32"] == "quadratic"
    assert d["quadratic_share"]["32"] == pytest.approx(2.048 / 4.048)


def test_svg_is_well_formed_with_one_polyline_per_series_and_markdown_lists_failures():
    data = _series()
    fits = analyse(data, 24.0)
    root = ET.fromstring(svg(data, fits, {"group": "G", "length": "L"}, 24.0))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    lines = [e.get("data-series") for e in root.iter("{http://www.w3.org/2000/svg}polyline")]
    # group: 2 sides x 2 metrics; length: meshrl's 2 metrics (TRL's only point timed out: no line)
    assert sorted(lines) == sorted([f"group/{m}/{s}" for m in ("time_s", "peak_gb") for s in ("meshrl", "trl")]
                                   + ["length/time_s/meshrl", "length/peak_gb/meshrl"])
    assert len(lines) == len(set(lines))
    texts = "".join(root.itertext())
    assert "×" in texts and "24 GB at" in texts
    table = markdown(data, fits, {"group": "G", "length": "L"}, 24.0)
    assert "| 64 | 1.14 | OOM |" in table and "| 32 | 1.32 | TIMEOUT |" in table
    assert "x at 24 GB" in table and "quadratic" in table


def _args(*argv: str) -> argparse.Namespace:
    return cost_growth.parse_args(["--mem-limit-gb", "0", *argv])


def test_grid_shares_the_base_point_and_reads_points():
    args = _args("--points", "group=4,8", "--points", "length=48,96", "--points", "model=tiny,random:smollm2-135m")
    keys = [p.key for p in cost_growth.grid(args)]
    assert len(keys) == len(set(keys)) == 2 * 4  # G4, G8 (base), L96, tiny; the base point once
    assert keys[:2] == ["meshrl random:smollm2-135m P4 G4 L48", "trl random:smollm2-135m P4 G4 L48"]
    values = cost_growth.axis_values(args)
    assert cost_growth.on_axis("length", "random:smollm2-135m", 4, 8, 96, args, values)
    assert not cost_growth.on_axis("length", "tiny", 4, 8, 96, args, values)
    for bad in ("group=4,x", "depth=3", "group"):
        with pytest.raises(SystemExit):
            cost_growth.axis_values(_args("--points", bad))


def test_step_phases_from_marker_times():
    marks = [(0.0, 0, "setup"), (1.0, 1, "step"), (1.5, 1, "rollout"), (3.0, 1, "update"), (4.0, 1, "optimizer"),
             (4.25, 1, "idle"), (4.3, 2, "step"), (4.4, 2, "rollout"), (5.0, 2, "update")]  # step 2 never ended
    phases = cost_growth.step_phases(marks)
    assert phases == {1: pytest.approx({"other": 0.5, "rollout": 1.5, "update": 1.0, "optimizer": 0.25})}


def test_classify_names_time_memory_and_errors():
    args = _args("--point-timeout", "9")
    args.mem_limit_gb = 3.0

    def run(rc: int, killed: str | None = None, report: dict | None = None) -> SideRun:
        return SideRun([], rc, report if report is not None else {}, TreeSampler(0), [], killed=killed)

    assert cost_growth.classify(run(0, report={"x": 1}), "", args) == ("ok", "")
    assert cost_growth.classify(run(-9, "timeout"), "", args)[0] == "timeout"
    assert cost_growth.classify(run(-9, "memory"), "", args) == ("oom", "process tree PSS past --mem-limit-gb 3.0")
    assert cost_growth.classify(run(-signal.SIGKILL), "", args)[0] == "oom"
    assert cost_growth.classify(run(1), "RuntimeError: DefaultCPUAllocator: can't allocate memory", args)[0] == "oom"
    status, reason = cost_growth.classify(run(1), "Traceback\nValueError: bad", args)
    assert status == "error" and "ValueError: bad" in reason


def test_a_point_records_the_cpu_it_ran_on_and_the_line_names_it(monkeypatch):
    """Every JSON line carries the child's ``cpu_info`` (its torch threads), or this process's where the child sent
    none (killed); ``describe``, the line every benchmark prints, names the model, capability, bf16 and flags."""
    from meshrl.cpu import cpu_info, describe

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = cpu_info()
    line = describe(info)
    assert line.startswith(f"cpu: {info['model']}; PyTorch capability {info['capability']}; native bf16 ")
    assert f"flags {','.join(info['flags']) or 'none'}" in line and line.endswith("ONEDNN_MAX_CPU_ISA=AVX2")
    child_cpu = {**info, "torch_threads": 1}
    point, args = cost_growth.Point("meshrl", "tiny", 2, 4, 8), _args("--warmup", "0", "--steps", "1")
    runs = iter([SideRun([], 0, {"response_len_mean": 8.0, "cpu": child_cpu}, TreeSampler(0), []),
                 SideRun([], -9, {}, TreeSampler(0), [], killed="timeout")])
    monkeypatch.setattr(cost_growth, "launch_side", lambda *a, **kw: next(runs))
    rec = cost_growth.run_point(point, "tiny", 1000, args)
    assert rec["cpu"] == child_cpu and "cpu" not in rec["child"]
    killed = json.loads(json.dumps(cost_growth.run_point(point, "tiny", 1000, args)))
    assert killed["status"] == "timeout" and killed["cpu"] == info


def test_bad_store_line_names_file_and_line(tmp_path: Path):
    out = tmp_path / "g.jsonl"
    out.write_text('{"key": "a", "status": "ok"}\nnot json\n')
    with pytest.raises(SystemExit, match=r"g\.jsonl:2: not a JSON line"):
        cost_growth.load_records(out)


def _sweep(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cost_growth.py"), "--axes", "group", "--sides", "meshrl",
           "--model", "tiny", "--prompts", "2", "--tokens", "8", "--steps", "1", "--threads", "1", "--interval",
           "0.02", "--set", "rollout.decode_workers=1", "--set", "train.update_workers=1", "--out", str(out),
           "--model-cache", str(tmp_path / "models"), *extra]
    return subprocess.run(cmd, env=env, timeout=150, capture_output=True, text=True)


def test_sweep_on_tiny_writes_json_lines_and_resumes(tmp_path: Path):
    out, figure = tmp_path / "growth.jsonl", tmp_path / "growth.svg"
    first = _sweep(tmp_path, out, "--points", "group=2,4", "--svg", str(figure))
    assert first.returncode == 0, first.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in records] == ["meshrl tiny P2 G2 L8", "meshrl tiny P2 G4 L8"]
    for r in records:
        assert r["status"] == "ok" and len(r["step_s"]) == 1 and r["time_s"] > 0 and r["steps_done"] == 2
        assert 0.05 < r["peak_gb"] < 8 and "rollout" in r["phase_s"] and "update" in r["phase_s"]
        assert r["params"] > 0 and r["settings"]["steps"] == 1
    ET.fromstring(figure.read_text())
    second = _sweep(tmp_path, out, "--points", "group=2,4")
    assert second.returncode == 0 and "2 points (2 already in" in second.stderr and "[1/" not in second.stderr
    assert len(out.read_text().splitlines()) == 2
    summary = json.loads(second.stdout.splitlines()[0])
    assert summary["points"] == 2 and summary["fits"]["group"]["meshrl"]["time_s"]["preferred"] == "linear"


@pytest.mark.parametrize(("limit", "status"), [(("--point-timeout", "1.5"), "timeout"),
                                               (("--mem-limit-gb", "0.02"), "oom")])
def test_a_point_past_its_limit_is_recorded_not_fatal(tmp_path: Path, limit: tuple[str, str], status: str):
    out = tmp_path / "growth.jsonl"
    proc = _sweep(tmp_path, out, "--points", "group=2", *limit)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert r["status"] == status and r["time_s"] is None and r["reason"]
