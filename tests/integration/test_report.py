"""``meshrl report``: plots from real tiny runs and an eval dir, a self-consistent escaped HTML page, and
tolerance of non-numeric values, missing metrics and missing files."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from meshrl.cli import report_cmd  # noqa: E402
from meshrl.report import build_report, load_inputs  # noqa: E402
from meshrl.report.data import as_number  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["model=tiny", "task=tiny:add", "steps=3", "rollout.prompts_per_step=2", "rollout.group_size=4",
         "rollout.max_new_tokens=4", "log.progress=false", "diag.mei.every=1", "eval.every=1", "eval.n=2",
         "eval.limit=4"]
ALL_PLOTS = ["alarms.png", "reward_accuracy.png", "eval_heldout.png", "mei.png", "effective_dirs.png", "entropy.png",
             "response_length.png", "divergence.png", "grad_ratio.png", "pass_at_k.png"]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real tiny runs (grpo; grpo_js in a directory named with ``<b>``), an eval dir, and a copy of the
    second run dressed up as a Mesh run (strategy masses, gradient ratio, prefix-group MEI, a logged MEI
    crossing) whose metrics also carry "nan" strings, a dropped metric and a garbage line."""
    from meshrl.evaluation import EvalConfig, run_eval
    from meshrl.trainer import load_config, train

    root = tmp_path_factory.mktemp("report_inputs")
    grpo, js = root / "grpo run", root / "js<b>run"
    train(load_config(overrides=["recipe=grpo", *SMALL]), grpo)
    train(load_config(overrides=["recipe=grpo_js", *SMALL]), js)
    ev = root / "eval_tiny"
    run_eval(EvalConfig(model="tiny", data="tiny:add", n=4, ks=[1, 2, 4], split="eval", limit=4, max_new_tokens=4),
             ev, progress=False)

    mesh = root / "mesh<b>"
    shutil.copytree(js, mesh, ignore=shutil.ignore_patterns("checkpoints"))
    rows = _read(mesh / "metrics.jsonl")
    for i, r in enumerate(rows):
        r.update({"strategy/mass/s0": 0.6 + 0.1 * i, "strategy/mass/s1": 0.4 - 0.1 * i,
                  "mesh/grad_ratio": 10.0 ** -i, "mei/prefix_group": 1.0 + 0.01 * i,
                  "mei/bias/prefix_group_effective_dirs": 2.0 - 0.1 * i, "mei/bias/prefix_group_group_size": 2.0})
    rows[0]["reward/mean"] = "nan"
    rows[1]["mei/query"] = "inf"
    rows[1]["mesh/grad_ratio"] = "-inf"
    del rows[-1]["entropy/mean"]
    _write(mesh / "metrics.jsonl", rows, tail="{not json\n")
    _write(mesh / "events.jsonl", [{"step": 2, "event": "mei_first_crossing", "mei": 1.2, "threshold": 1.05}])
    (mesh / "summary.json").unlink()
    return {"grpo": grpo, "js": js, "eval": ev, "mesh": mesh}


def _check_page(index: Path) -> str:
    text = index.read_text()
    refs = re.findall(r'src="([^"]+)"', text)
    assert refs, "the page shows no plots"
    for ref in refs:
        target = index.parent / ref
        assert target.is_file(), f"index.html references missing {ref}"
        assert target.read_bytes()[:8] == PNG_MAGIC
    return text


def test_report_writes_every_plot_and_a_consistent_page(inputs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "rep"
    index = build_report([inputs["grpo"], inputs["js"], inputs["mesh"], inputs["eval"]], out)
    assert index == out / "index.html"
    for name in ALL_PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name
    masses = sorted(p.name for p in out.glob("strategy_mass_*.png"))
    assert len(masses) == 1 and "mesh" in masses[0]  # one per run that has strategy masses
    text = _check_page(index)
    refs = set(re.findall(r'src="([^"]+)"', text))
    assert refs == set(ALL_PLOTS) | set(masses)
    for needed in ("grpo run (grpo)", "grpo_js", "eval_tiny (tiny:add)", "pass@4", "mean@2",
                   "MEI scale", "query scale", "prefix-group scale", "first crossing at step 2 (logged)",
                   "mesh.mu", "rollouts/count (sum)", "best held-out", "final held-out", "Generated"):
        assert needed in text, needed
    assert "<td>24</td>" in text  # rollouts/count sum: 3 steps x 2 prompts x 4 rollouts


def test_text_is_escaped(inputs: dict[str, Path], tmp_path: Path) -> None:
    text = build_report([inputs["js"], inputs["mesh"]], tmp_path / "rep").read_text()
    assert "<b>run" not in text and "mesh<b>" not in text
    assert "js&lt;b&gt;run (grpo_js)" in text and "mesh&lt;b&gt;" in text


def test_nan_strings_missing_metrics_and_files_do_not_crash(inputs: dict[str, Path], tmp_path: Path) -> None:
    (run,), _ = load_inputs([inputs["mesh"]])
    steps, values = run.series("reward/mean")
    assert steps == [2.0, 3.0] and all(isinstance(v, float) for v in values)  # "nan" at step 1 skipped
    assert run.series("mei/query")[0] == [1.0, 3.0]
    assert run.series("entropy/mean")[0] == [1.0, 2.0]
    assert any("unreadable" in n for n in run.notes)
    # a bare run: only metrics.jsonl, only reward/mean (one of them "nan"), no config/events/summary
    bare = tmp_path / "bare"
    bare.mkdir()
    _write(bare / "metrics.jsonl", [{"step": 1, "reward/mean": "nan"}, {"step": 2, "reward/mean": 0.5},
                                    {"reward/mean": 0.25, "acc/mean": None}])
    out = tmp_path / "rep"
    text = _check_page(build_report([bare], out))
    # the "nan" reward is the doctor's nonfinite alarm, marked on the alarms plot
    assert sorted(p.name for p in out.glob("*.png")) == ["alarms.png", "reward_accuracy.png"]
    assert "doctor alarm nonfinite at step 1" in text
    assert "config.yaml missing" in text and "no data in: bare (?)" in text
    # a run whose metrics hold nothing numeric at all: a page with no plots
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty / "metrics.jsonl", [{"step": "x", "reward/mean": "nan"}])
    text = build_report([empty], tmp_path / "rep2").read_text()
    assert "No plottable data" in text and not list((tmp_path / "rep2").glob("*.png"))


def test_bad_input_names_the_path(tmp_path: Path) -> None:
    stray = tmp_path / "not_a_run"
    stray.mkdir()
    (stray / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not_a_run"):
        build_report([stray], tmp_path / "rep")
    with pytest.raises(ValueError, match="no_such_dir"):
        build_report([tmp_path / "no_such_dir"], tmp_path / "rep")
    with pytest.raises(ValueError, match="at least one"):
        build_report([], tmp_path / "rep")
    assert not (tmp_path / "rep").exists()


def test_as_number() -> None:
    assert as_number(3) == 3.0 and as_number(0.5) == 0.5
    for bad in ("nan", "inf", "0.5", None, True, float("nan"), float("-inf"), [1], {"a": 1}):
        assert as_number(bad) is None, bad


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    report_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_cli_prints_index_path(inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cli"
    args = _parse(["report", str(inputs["grpo"]), str(inputs["eval"]), "--out", str(out), "--title", "A<&>B"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(out / "index.html")
    assert "<title>A&lt;&amp;&gt;B</title>" in (out / "index.html").read_text()


def test_missing_matplotlib_is_a_clear_error(inputs: dict[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    args = _parse(["report", str(inputs["grpo"]), "--out", str(tmp_path / "rep")])
    assert args.func(args) == 1
    assert "meshrl[report]" in capsys.readouterr().err


class _Sections(HTMLParser):
    """Collects, per run block of the Diagnosis section, the finding ids and their severities."""

    def __init__(self) -> None:
        super().__init__()
        self.h2: list[str] = []
        self.in_h2 = False
        self.runs: dict[str, list[tuple[str, str]]] = {}
        self.current: str | None = None
        self.in_diagnosis = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id") == "diagnosis":
            self.in_diagnosis = True
        if tag == "h2":
            self.in_h2 = True
        if self.in_diagnosis and tag == "div" and "data-run" in a:
            self.current = a["data-run"]
            self.runs[self.current] = []
        if self.in_diagnosis and tag == "div" and "data-finding" in a and self.current is not None:
            severity = (a.get("class") or "").split()[-1]
            self.runs[self.current].append((a["data-finding"], severity))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.in_diagnosis = False
        if tag == "h2":
            self.in_h2 = False

    def handle_data(self, data: str) -> None:
        if self.in_h2:
            self.h2.append(data.strip())


def _diagnosed_page(inputs: dict[str, Path], out: Path) -> Path:
    return build_report([inputs["grpo"], inputs["mesh"]], out)


def test_diagnosis_section_lists_each_runs_findings(inputs: dict[str, Path], tmp_path: Path) -> None:
    index = _diagnosed_page(inputs, tmp_path / "rep")
    parsed = _Sections()
    parsed.feed(index.read_text())
    assert "Diagnosis" in parsed.h2 and parsed.h2.index("Diagnosis") < parsed.h2.index("Runs")
    assert set(parsed.runs) == {"grpo run (grpo)", "mesh<b> (grpo_js)"}  # attribute values, unescaped by the parser
    # The dressed-up copy carries "nan" / "inf" metrics: the doctor names the non-finite steps there only.
    assert ("nonfinite", "alarm") in parsed.runs["mesh<b> (grpo_js)"]
    assert "nonfinite" not in [fid for fid, _ in parsed.runs["grpo run (grpo)"]]
    text = index.read_text()
    assert "not checked (" in text and "mesh&lt;b&gt;" in text and "<b>run" not in text


def test_a_failing_doctor_costs_the_diagnosis_not_the_report(inputs: dict[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that raised (a metric logged only as NaN made one call fmean on nothing) ended `meshrl report`."""
    import meshrl.doctor

    def broken(*args, **kwargs):
        raise ArithmeticError("a check failed")

    monkeypatch.setattr(meshrl.doctor, "diagnose", broken)
    text = _diagnosed_page(inputs, tmp_path / "rep").read_text()
    assert "not diagnosed: the doctor failed (ArithmeticError: a check failed)" in text


def test_effective_directions_plot_says_which_reading_it_shows(inputs: dict[str, Path], tmp_path: Path) -> None:
    (run,), _ = load_inputs([inputs["grpo"]])
    assert run.has("mei/directions") and run.has("mei/g_over_mei")
    text = build_report([inputs["grpo"]], tmp_path / "rep").read_text()
    assert "mean over queries of the effective directions (mei/directions" in text
    assert "G / MEI" not in text.split("Effective directions", 1)[1].split("</figure>", 1)[0]


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no headless browser (apt-get install -y chromium)")
def test_diagnosis_renders_in_a_headless_browser(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A real browser draws the page: the alarm finding's red border (#c62828) is on the screenshot."""
    import subprocess

    from matplotlib.image import imread

    index = _diagnosed_page(inputs, tmp_path / "rep")
    shot = tmp_path / "shot.png"
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1280,1400", index.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = imread(shot)[..., :3]
    red = ((abs(pixels[..., 0] - 198 / 255) < 0.03) & (abs(pixels[..., 1] - 40 / 255) < 0.03)
           & (abs(pixels[..., 2] - 40 / 255) < 0.03))
    assert int(red.sum()) >= 5 * 20  # a 5-pixel border at least 20 pixels tall


def test_held_out_plot_leaves_out_counts_and_keeps_measures():
    from meshrl.report.plots import _plotted_eval_key

    assert not any(_plotted_eval_key(k) for k in ("eval/reward_errors", "eval/skipped_long_prompts",
                                                  "eval/reward_timeouts", "eval/by/decade/problems"))
    assert all(_plotted_eval_key(k) for k in ("eval/mean@1", "eval/by/decade/mean@1", "eval/pass@4",
                                              "eval/strategy/max_mass"))
