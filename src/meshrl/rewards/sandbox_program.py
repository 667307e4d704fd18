"""The sandboxed side of :func:`meshrl.rewards.sandbox.run_code`: runs the untrusted code and serves calls.

Embedded (after :mod:`meshrl.rewards.sandbox_codec`) into ``python -I -B -c`` inside the sandbox; argv:
``REQUEST_FD REPLY_FD UID GID WORKDIR``. With ``UID >= 0`` it first drops to that user (bubblewrap as
root keeps only ``CAP_SETUID``/``CAP_SETGID`` for this; nothing untrusted has run yet). Then it reads
the code from stdin, runs it as ``__main__``, reports which names it defined, and answers
``{"call": name, "args": [...], "kwargs": {...}}`` requests with ``{"ok": value}`` or ``{"raised": ...}``
until the harness closes the request pipe.

Nothing here is trusted: the code can replace any of these functions, write anything to any descriptor
it holds, or exit at any moment. It never sees the tests, and the harness believes only values it
decodes itself (:func:`~meshrl.rewards.sandbox_codec.decode_value`), so all it can do is return values.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import linecache
import os
import socket
import sys
import traceback
import types

from meshrl.rewards.sandbox_codec import (  # sandbox: inline
    decode_value,  # sandbox: inline
    encode_value,  # sandbox: inline
    lift_int_digit_limit,  # sandbox: inline
    recv_message,  # sandbox: inline
    send_message,  # sandbox: inline
)  # sandbox: inline


def _deny(*args: object, **kwargs: object) -> None:
    raise PermissionError("network access is disabled in the meshrl sandbox")


class _GuardedSocket(socket.socket):
    """Best effort only, for the mechanisms without a network namespace (``_socket`` bypasses it)."""

    def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            _deny()
        super().__init__(family, type, proto, fileno)


def _describe(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000]}


def _flush_and_exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status)


def _defined_names(ns: dict) -> dict:
    """The code's top-level callables (by name) and its other top-level values that are plain literals."""
    callables, values = [], {}
    for name, value in list(ns.items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        if callable(value):
            callables.append(name)
            continue
        try:
            values[name] = encode_value(value)
        except (TypeError, ValueError, RecursionError):
            continue
    return {"callables": callables, "values": values}


def _serve(ns: dict, request_fd: int, reply_fd: int) -> None:
    while True:
        request = recv_message(request_fd)
        if request is None:
            _flush_and_exit(0)
        name = request.get("call")
        try:
            fn = ns.get(name) if isinstance(name, str) else None
            if not callable(fn):
                raise NameError(f"name {name!r} is not a callable defined by the program")
            result = fn(*decode_value(request["args"]), **decode_value(request["kwargs"]))
            reply = {"ok": encode_value(result)}
        except SystemExit as exc:
            reply = {"exited": repr(exc.code)}
        except BaseException as exc:
            traceback.print_exc()
            reply = {"raised": _describe(exc)}
        send_message(reply_fd, reply)


def main() -> None:
    request_fd, reply_fd, uid, gid = (int(arg) for arg in sys.argv[1:5])
    lift_int_digit_limit()
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.chdir(sys.argv[5])
    code = json.loads(sys.stdin.buffer.read())["code"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    socket.socket = _GuardedSocket  # type: ignore[misc]
    socket.getaddrinfo = socket.gethostbyname = socket.gethostbyname_ex = _deny  # type: ignore[assignment]
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        linecache.cache["solution.py"] = (len(code), None, code.splitlines(True), "solution.py")
        exec(compile(code, "solution.py", "exec"), ns)
    except SystemExit as exc:
        send_message(reply_fd, {"exited": repr(exc.code)})
        _flush_and_exit(1)
    except BaseException as exc:
        traceback.print_exc()
        send_message(reply_fd, {"raised": _describe(exc)})
        _flush_and_exit(1)
    send_message(reply_fd, {"loaded": _defined_names(ns)})
    _serve(ns, request_fd, reply_fd)
