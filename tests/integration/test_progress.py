"""meshrl.progress: a rich bar on a terminal, plain lines elsewhere (logs, CI), nothing when disabled."""

from __future__ import annotations

import io

from meshrl.progress import PlainProgress, progress_bar


def test_plain_progress_prints_a_line_per_twentieth_and_at_the_end():
    out = io.StringIO()
    bar = PlainProgress("warm", 100, stream=out)
    for step in range(100):
        bar.advance(description=f"loss {1 / (step + 1):.3f}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 20
    assert lines[0].startswith("warm: 5/100 (5%), ") and "eta " in lines[0] and lines[0].endswith("loss 0.200")
    assert lines[-1].startswith("warm: 100/100 (100%), ") and "eta" not in lines[-1]


def test_plain_progress_odd_totals_completed_and_resume():
    out = io.StringIO()
    bar = PlainProgress("train", 7, start=3, stream=out)
    bar.advance(completed=5)
    bar.advance(2)
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == ["train: 5/7 (71%)", "train: 7/7 (100%)"]


def test_progress_bar_is_plain_when_stderr_is_not_a_terminal(capsys):
    with progress_bar("eval", 3) as advance:  # pytest's captured stderr is not a terminal
        for _ in range(3):
            advance()
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("eval: 3/3 (100%)") and "\x1b" not in err
    with progress_bar("eval", 3, enabled=False) as advance:
        advance()
    assert capsys.readouterr().err == ""
