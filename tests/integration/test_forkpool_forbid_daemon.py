"""meshrl inside a daemonic process (which may not have children) decodes in that process: a spawned process runs
the native backend (``forbid_fork`` itself: tests/unit/test_forkpool_forbid.py)."""

from __future__ import annotations

from meshrl import forkpool


def _decode_in_a_daemon(conn) -> None:
    from meshrl.models import build_tiny
    from meshrl.rollout import make_backend
    from meshrl.rollout.base import SamplingParams

    model, tok = build_tiny("tiny", seed=0)
    native = make_backend("native", model, tok, workers=2)
    out = native.generate([[1, 5, 6]], SamplingParams(n=32, temperature=1.0, max_new_tokens=3), seed=0)
    conn.send((forkpool.fork_available(), len(out.response_ids), native.workers))


def test_a_daemonic_process_decodes_without_children():
    """multiprocessing forbids a daemonic process children (an AssertionError from ``Process.start``): meshrl used
    inside one (a ``multiprocessing.Pool`` worker, say) decodes in that process instead of crashing."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_in_a_daemon, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120), "the daemonic process sent nothing"
    assert parent.recv() == (False, 32, 1)
    proc.join(30)
    assert proc.exitcode == 0
