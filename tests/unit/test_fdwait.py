"""wait_readable: data, end of file and the timeout on a pipe, also at descriptor numbers select() refuses."""

from __future__ import annotations

import os
import resource
import time

import pytest

from meshrl.rewards.fdwait import wait_readable


@pytest.mark.parametrize("high", [False, True], ids=["low-fd", "fd-1500"])
def test_data_eof_and_timeout(high: bool) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if high and soft <= 1500:
        if hard != resource.RLIM_INFINITY and hard <= 1500:
            pytest.skip("the descriptor limit is below 1501")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1600, hard))
    r, w = os.pipe()
    try:
        if high:  # the read end at 1500: past FD_SETSIZE (1024), where select() raises
            os.dup2(r, 1500)
            os.close(r)
            r = 1500
        t0 = time.monotonic()
        assert wait_readable(r, 0.2) is False and time.monotonic() - t0 >= 0.15
        os.write(w, b"x")
        assert wait_readable(r, 5.0) is True and os.read(r, 1) == b"x"
        os.close(w)
        w = -1
        assert wait_readable(r, None) is True and os.read(r, 1) == b""  # end of file counts as readable
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        if high and soft <= 1500:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
