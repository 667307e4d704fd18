"""Coach backends: an OpenAI-compatible chat endpoint (stdlib only), any callable, and rule coaches.

A chat backend is anything with ``complete(messages: list[dict]) -> str`` (:class:`ChatBackend`).
Transport failures that survive the backend's own retries raise :class:`BackendError`, which
:func:`meshrl.mesh.coach.generate_prefixes` records as a failed attempt; any other exception aborts the
run (the prefix cache is written query by query, so a re-run resumes).

API keys: :class:`OpenAIChatBackend` reads the key from the environment variable named by
``api_key_env`` at every call. The key is sent only in the ``Authorization: Bearer`` header; it is never
logged, never stored on the object, and redacted from error messages and returned text. An unset
variable raises :class:`MissingKeyError`, which ends the run at the first call instead of failing every
attempt of every query. Credentials in the URL (``http://user:KEY@host/v1``) are taken out of it: the
request goes to the URL without them (with HTTP Basic authentication from them when no key variable is
used), and only the redacted URL (``http://user:***@host/v1``) appears in messages, logs and the cache.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("meshrl.mesh.coach")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class BackendError(RuntimeError):
    """A coach call failed after its retries (message safe to log: no key, no request headers)."""


class MissingKeyError(BackendError, ValueError):
    """The ``api_key_env`` variable is not set: a set-up error that no retry can fix."""


def redact_url(url: str) -> str:
    """``url`` with any password (and a user name that looks like a key) replaced by ``***``."""
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parsed.netloc:
        return url
    userinfo, host = parsed.netloc.rsplit("@", 1)
    user, has_password, _ = userinfo.partition(":")
    safe = f"{user}:***" if has_password else "***"
    return urllib.parse.urlunsplit(parsed._replace(netloc=f"{safe}@{host}"))


def _split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``(url without user info, user, password)``."""
    parsed = urllib.parse.urlsplit(url)
    if "@" not in parsed.netloc:
        return url, None, None
    host = parsed.netloc.rsplit("@", 1)[1]
    user = urllib.parse.unquote(parsed.username) if parsed.username else None
    password = urllib.parse.unquote(parsed.password) if parsed.password else None
    return urllib.parse.urlunsplit(parsed._replace(netloc=host)), user, password


@runtime_checkable
class ChatBackend(Protocol):
    """The one protocol every text-generating coach implements."""

    def complete(self, messages: list[dict]) -> str: ...


def describe_backend(backend: object) -> dict[str, Any]:
    """A JSON-able description of a backend for the prefix cache (never contains a key)."""
    describe = getattr(backend, "describe", None)
    if callable(describe):
        return dict(describe())
    return {"backend": type(backend).__name__}


def _redact(text: str, secret: str | None) -> str:
    if secret and secret in text:
        return text.replace(secret, "[REDACTED]")
    return text


class OpenAIChatBackend:
    """Client of an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (vLLM, SGLang, hosted).

    Args:
        base_url: API root including the version, as the OpenAI SDK takes it (``http://127.0.0.1:8000/v1``);
            a URL that already ends in ``/chat/completions`` is used as is.
        model: model name sent in the request.
        api_key_env: name of the environment variable holding the key, read at call time; ``None`` sends
            no ``Authorization`` header (local servers). Named but unset is an error at call time.
        timeout_s: socket timeout of one request (connect and each read).
        max_retries: retries after the first try on HTTP 429, HTTP 5xx, timeouts and connection errors;
            other 4xx answers fail at once.
        backoff_s: first back-off; the k-th retry waits ``backoff_s * 2**(k-1)`` (times a jitter in
            [1, 1.25) when ``jitter``), at least the server's ``Retry-After``, at most ``max_backoff_s``.
        concurrency: requests in flight at once (a semaphore); ``generate_prefixes`` sizes its thread
            pool from it.
        temperature, max_tokens, extra_body: optional request fields.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 120.0,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        max_backoff_s: float = 60.0,
        jitter: bool = True,
    ) -> None:
        try:
            parsed = urllib.parse.urlparse(base_url or "")
            parsed.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            raise ValueError(f"base_url is not a valid URL: {redact_url(str(base_url))!r}") from None
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url must be an http(s) URL, got {redact_url(str(base_url))!r}")
        if not model:
            raise ValueError("model must be a non-empty string")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s}, {max_backoff_s}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        root, user, password = _split_credentials(base_url.rstrip("/"))
        self.url = root if root.endswith("/chat/completions") else root + "/chat/completions"  # no credentials
        self._secrets = tuple(s for s in (password, user if password is None else None) if s)
        self._basic = None
        if user is not None or password is not None:
            token = f"{user or ''}:{password or ''}".encode()
            self._basic = "Basic " + base64.b64encode(token).decode()
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.jitter = jitter
        self.concurrency = int(concurrency)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self.http_requests = 0  # every HTTP attempt, retries included
        handlers = [urllib.request.ProxyHandler({})] if parsed.hostname in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)

    def describe(self) -> dict[str, Any]:
        return {"backend": "openai", "url": self.url, "model": self.model, "api_key_env": self.api_key_env}

    def __repr__(self) -> str:
        return f"OpenAIChatBackend(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def _key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise MissingKeyError(f"environment variable {self.api_key_env} (api_key_env) is not set")
        return key

    def preflight(self) -> None:
        """Raise :class:`MissingKeyError` now if the key variable is unset (before any query is tried)."""
        self._key()

    def _redact(self, text: str, key: str | None) -> str:
        for secret in (key, *self._secrets):
            text = _redact(text, secret)
        return text

    def _body(self, messages: list[dict]) -> bytes:
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.extra_body}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return json.dumps(body).encode("utf-8")

    def _wait(self, retry: int, retry_after: float | None) -> None:
        delay = self.backoff_s * 2 ** (retry - 1)
        if self.jitter:
            delay *= 1.0 + 0.25 * random.random()
        if retry_after is not None:
            delay = max(delay, retry_after)
        time.sleep(min(delay, self.max_backoff_s))

    def complete(self, messages: list[dict]) -> str:
        """Send one chat request and return ``choices[0].message.content``; retries as documented."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts")
        key = self._key()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        elif self._basic is not None:
            headers["Authorization"] = self._basic
        data = self._body(messages)
        last = "no attempt made"
        with self._slots:
            for attempt in range(self.max_retries + 1):
                retry_after = None
                with self._lock:
                    self.http_requests += 1
                try:
                    req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
                    with self._opener.open(req, timeout=self.timeout_s) as resp:
                        payload = resp.read()
                    return self._redact(_content(payload, self.url), key)
                except urllib.error.HTTPError as e:
                    detail = self._redact(_read_error(e), key)
                    last = f"HTTP {e.code} from {self.url}: {detail}"
                    if e.code != 429 and e.code < 500:
                        raise BackendError(last) from None
                    retry_after = _retry_after(e)
                except TimeoutError:
                    last = f"timeout after {self.timeout_s:g}s from {self.url}"
                except urllib.error.URLError as e:
                    reason = e.reason
                    if isinstance(reason, TimeoutError):
                        last = f"timeout after {self.timeout_s:g}s from {self.url}"
                    else:
                        last = f"connection error to {self.url}: {self._redact(str(reason), key)}"
                except (ConnectionError, http.client.HTTPException) as e:
                    last = f"connection error to {self.url}: {type(e).__name__}"
                if attempt < self.max_retries:
                    log.warning("coach request failed (%s); retry %d/%d", last, attempt + 1, self.max_retries)
                    self._wait(attempt + 1, retry_after)
        raise BackendError(f"{last} (after {self.max_retries + 1} tries)")


def _read_error(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the body is only a detail of the message
        text = ""
    return " ".join(text.split())[:300] or e.reason or ""


def _retry_after(e: urllib.error.HTTPError) -> float | None:
    value = e.headers.get("Retry-After") if e.headers else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _content(payload: bytes, url: str) -> str:
    try:
        obj = json.loads(payload.decode("utf-8"))
        content = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BackendError(f"response from {url} has no choices[0].message.content") from None
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise BackendError(f"response from {url} has a non-text message content")
    return content


class CallableBackend:
    """Wrap any ``fn(messages) -> str`` (e.g. a local transformers chat generator) as a coach backend.

    ``concurrency`` defaults to 1: a local model is usually not safe to call from several threads.
    Exceptions raised by ``fn`` propagate, except :class:`BackendError`, which counts as a failed attempt.
    """

    def __init__(self, fn: Callable[[list[dict]], str], *, concurrency: int = 1, name: str = "callable") -> None:
        if not callable(fn):
            raise ValueError("fn must be callable")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.fn = fn
        self.concurrency = concurrency
        self.name = name

    def describe(self) -> dict[str, Any]:
        return {"backend": "callable", "name": self.name}

    def complete(self, messages: list[dict]) -> str:
        out = self.fn(messages)
        if not isinstance(out, str):
            raise BackendError(f"{self.name} returned {type(out).__name__}, not str")
        return out


class RuleCoach:
    """Coach for built-in tasks whose strategies are known: no text generation.

    ``strategies_for(query)`` gets the query dict (``id``, ``problem``, ``answer``, and any other
    fields the caller put there) and returns the strategy prefixes, or ``None`` when it has none for
    that query (the query is then rejected with that reason). If it returns more than m prefixes the
    first m are used; the usual validation (length, distinctness, leak) still applies.
    """

    concurrency = 1

    def __init__(self, strategies_for: Callable[[dict], list[str] | None], *, name: str = "rule") -> None:
        if not callable(strategies_for):
            raise ValueError("strategies_for must be callable")
        self.strategies_for = strategies_for
        self.name = name

    def describe(self) -> dict[str, Any]:
        return {"backend": "rule", "name": self.name}

    def propose(self, query: dict, m: int) -> list[str] | None:
        out = self.strategies_for(query)
        if out is None:
            return None
        if isinstance(out, str) or not all(isinstance(s, str) for s in out):
            raise ValueError(f"strategies_for must return a list of str or None, got {out!r:.80}")
        return list(out)[:m]
