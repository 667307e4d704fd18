"""The trusted side of :func:`meshrl.rewards.sandbox.run_code`: runs the tests and decides the verdict.

Embedded (after :mod:`meshrl.rewards.sandbox_codec`) into ``python -I -B -c`` OUTSIDE the sandbox, as
the caller's user, under the same rlimits; argv: ``REQUEST_FD REPLY_FD VERDICT_FD``; stdin: the JSON
``{"tests": ..., "entry_point": ..., "trusted_code": ...}``. The tests run here, in a namespace where every top-level
callable the program defined is a proxy: calling it sends the (literal) arguments to the sandboxed
process and returns the decoded (literal) result, or raises the exception the program raised, rebuilt
as a built-in exception type (never the program's own class). ``trusted_code`` (e.g. the problem's
prompt) runs here before the tests, so the helpers the tests call are the dataset's, not copies the
program may have redefined; only the entry point stays the program's. The verdict goes to ``VERDICT_FD``, a pipe
only this process holds, so nothing the program prints, writes or patches can reach it.

Verdicts: ``passed``; ``failed`` (an ``AssertionError`` in the tests or the code); ``exited`` (the program
exited or died before the tests finished; the caller refines it with the exit status); ``memory``;
``error`` (anything else: a ``SyntaxError``, a missing entry point, a non-literal result, a message that
is not well formed).
"""

from __future__ import annotations

import builtins
import json
import linecache
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from meshrl.rewards.sandbox_codec import (  # sandbox: inline
    ProtocolError,  # sandbox: inline
    decode_value,  # sandbox: inline
    encode_value,  # sandbox: inline
    lift_int_digit_limit,  # sandbox: inline
    recv_message,  # sandbox: inline
    send_message,  # sandbox: inline
)  # sandbox: inline


class ProgramExited(BaseException):
    """The program exited or died; a BaseException so that a test's ``except Exception`` cannot eat it."""


class BrokenChannel(BaseException):
    """The program sent something that is not a well-formed reply (it tampered with the channel)."""


class CandidateError(Exception):
    """An exception the program raised whose type is not a built-in exception."""


# Exceptions Python's own machinery catches: ``StopIteration`` out of a candidate mapped over the inputs
# (``zip(xs, map(candidate, xs))``, a generator expression, ``next``) silently ends the loop that holds the asserts.
_CONTROL_FLOW = (StopIteration,)


def _rebuild(raised: Any) -> BaseException:
    """A built-in exception for the program's ``{"type", "message"}``; its own classes never cross."""
    if type(raised) is not dict or type(raised.get("type")) is not str or type(raised.get("message")) is not str:
        return BrokenChannel("malformed exception report")
    cls = getattr(builtins, raised["type"], None)
    if cls in _CONTROL_FLOW:  # would end the tests' own loops: a candidate raising it must fail, not stop a map()
        return CandidateError(f"{raised['type']} raised by the program: {raised['message']}")
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(raised["message"])
    if raised["type"] == "MemoryError":
        return MemoryError(raised["message"])
    return CandidateError(f"{raised['type']}: {raised['message']}")


class Remote:
    """The request/reply pipes to the sandboxed program."""

    def __init__(self, request_fd: int, reply_fd: int) -> None:
        self.request_fd, self.reply_fd = request_fd, reply_fd

    def receive(self, during: str) -> dict:
        try:
            message = recv_message(self.reply_fd)
        except ProtocolError as exc:
            raise BrokenChannel(f"{during}: {exc}") from None
        if message is None:
            raise ProgramExited(f"the program exited {during}")
        if "exited" in message:
            raise ProgramExited(f"the program exited (SystemExit({message['exited']})) {during}")
        return message

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        request = {"call": name, "args": encode_value(list(args)), "kwargs": encode_value(kwargs)}
        try:
            send_message(self.request_fd, request)
        except OSError:
            raise ProgramExited(f"the program exited before a call to {name}()") from None
        reply = self.receive(f"during a call to {name}()")
        if "ok" in reply:
            try:
                return decode_value(reply["ok"])
            except (ProtocolError, RecursionError) as exc:
                raise BrokenChannel(f"{name}() returned a malformed value: {exc}") from None
        if "raised" in reply:
            raise _rebuild(reply["raised"])
        raise BrokenChannel(f"unexpected reply to a call to {name}()")

    def proxy(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, args, kwargs)

        call.__name__ = call.__qualname__ = name
        return call


def _status(exc: BaseException) -> str:
    if isinstance(exc, ProgramExited):
        return "exited"
    if isinstance(exc, AssertionError):
        return "failed"
    return "memory" if isinstance(exc, MemoryError) else "error"


def _load(remote: Remote) -> dict:
    """The names the program defined, or the program's own top-level exception re-raised."""
    message = remote.receive("before its code finished running")
    if "raised" in message:
        raise _rebuild(message["raised"])
    loaded = message.get("loaded")
    if type(loaded) is not dict or type(loaded.get("callables")) is not list or type(loaded.get("values")) is not dict:
        raise BrokenChannel("malformed load report")
    return loaded


_BUILTIN_NAMES = frozenset(dir(builtins))


def _may_bind(name: Any, *, entry_point: str | None) -> bool:
    """Whether a name the program defined may be bound in the tests' namespace. Never a built-in's name (other
    than the entry point's): a program defining ``abs`` or ``set`` would otherwise answer the tests' own
    ``assert abs(candidate(x) - y) < 1e-6`` or ``set(candidate(x)) == set(y)`` and pass them, and the trusted
    helpers that call built-ins would call it too."""
    return type(name) is str and name.isidentifier() and (name == entry_point or name not in _BUILTIN_NAMES)


def run_tests(payload: dict, remote: Remote) -> str:
    """The verdict for the program behind ``remote`` under ``payload``'s tests (module docstring)."""
    try:
        loaded = _load(remote)
        ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        for name, value in loaded["values"].items():
            if _may_bind(name, entry_point=payload["entry_point"]):
                ns[name] = decode_value(value)
        for name in loaded["callables"]:
            if _may_bind(name, entry_point=payload["entry_point"]):
                ns[name] = remote.proxy(name)
        tests, entry_point, trusted = payload["tests"], payload["entry_point"], payload.get("trusted_code")
        if trusted is not None:  # e.g. the problem's prompt: its helpers win over the program's copies
            linecache.cache["trusted.py"] = (len(trusted), None, trusted.splitlines(True), "trusted.py")
            exec(compile(trusted, "trusted.py", "exec"), ns)
            if entry_point and entry_point in loaded["callables"]:
                ns[entry_point] = remote.proxy(entry_point)
        if tests is not None:
            linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")
            exec(compile(tests, "tests.py", "exec"), ns)
        if entry_point:
            if not callable(ns.get("check")) or entry_point not in loaded["callables"]:
                raise NameError(f"check() or entry point {entry_point!r} is not defined")
            ns["check"](remote.proxy(entry_point))
        return "passed"
    except BaseException as exc:
        if isinstance(exc, ProgramExited):  # its message already says when ("before its code finished running")
            print(f"sandbox: {exc}", file=sys.stderr)
        else:
            traceback.print_exc()
        return _status(exc)


def main() -> None:
    request_fd, reply_fd, verdict_fd = (int(arg) for arg in sys.argv[1:4])
    lift_int_digit_limit()
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    status = run_tests(payload, Remote(request_fd, reply_fd))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(verdict_fd, status.encode())
        os._exit(0)
