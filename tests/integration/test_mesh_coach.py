"""Coach Prompting: validation, templates, budgets, and the OpenAI backend against a real loopback server."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshrl.mesh import budget_groups
from meshrl.mesh.coach import (
    BackendError,
    CallableBackend,
    ChatBackend,
    OpenAIChatBackend,
    PrefixRules,
    RuleCoach,
    baseline_group_size,
    check_answer,
    coach_messages,
    generate_prefixes,
    leaks_answer,
    load_prefix_records,
    load_prefixes,
    parse_strategies,
    query_key,
    wrap_prefix,
)

KEY_ENV = "MESHRL_TEST_COACH_KEY"
SECRET = "sk-test-5ecr3t-Zq9"

GOOD = [
    ("Work backwards", "Start from what the question asks for and reason backwards to the given facts."),
    ("Draw a diagram", "Sketch the situation so the relations between the quantities become visible."),
    ("Look for invariants", "Find a quantity that never changes; it constrains what can happen."),
    ("Small cases first", "Try tiny versions of the problem by hand and look for a pattern to generalise."),
]


def good_answer(fenced: bool = False) -> str:
    body = json.dumps({"strategies": [{"name": n, "prefix": p} for n, p in GOOD]})
    return f"Here you go:\n```json\n{body}\n```" if fenced else body


def leaking_answer() -> str:
    items = [{"name": n, "prefix": p} for n, p in GOOD]
    items[2]["prefix"] = "Notice the total must be 42 and check it."
    return json.dumps({"strategies": items})


# ---------------------------------------------------------------- a real HTTP server on 127.0.0.1


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):  # noqa: N802 - http.server API
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
            n = len(srv.requests)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        done = False

        def leave() -> None:  # before the reply goes out: once the client has it, it may send the next request
            nonlocal done
            if not done:
                done = True
                with srv.lock:
                    srv.in_flight -= 1

        try:
            action = srv.respond(body, n)
            kind = action[0]
            if kind == "sleep":
                time.sleep(action[1])
                action = action[2]
                kind = action[0]
            leave()
            if kind == "ok":
                payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": action[1]}}]})
                self._send(200, payload)
            else:  # ("status", code, body)
                self._send(action[1], action[2])
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            leave()

    def _send(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.lock = threading.Lock()
    srv.requests = []
    srv.in_flight = srv.max_in_flight = 0
    srv.respond = lambda body, n: ("ok", good_answer())
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    srv.base_url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def make_backend(srv, **kw) -> OpenAIChatBackend:
    opts = dict(api_key_env=KEY_ENV, timeout_s=5.0, max_retries=2, backoff_s=0.001, concurrency=2, jitter=False)
    opts.update(kw)
    return OpenAIChatBackend(srv.base_url, "coach-model", **opts)


def problem_of(body: dict) -> str:
    return body["messages"][1]["content"]


QUERIES = [
    {"id": "p1", "problem": "A train travels 120 km in 2 hours. What is its speed?", "answer": "60"},
    {"id": "p2", "problem": "How many primes are below 20?", "answer": "8"},
    {"id": "p3", "problem": "What is the sum of the interior angles of a hexagon?", "answer": "720"},
]


def _no_secret_anywhere(tmp_path, caplog, capsys, *extra: str) -> None:
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(), path
    out = capsys.readouterr()
    assert SECRET not in caplog.text and SECRET not in out.out and SECRET not in out.err
    for text in extra:
        assert SECRET not in text


def test_openai_backend_well_formed_answers(server, tmp_path, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    backend = make_backend(server)
    monkeypatch.setenv(KEY_ENV, SECRET)  # read at call time, after construction
    assert isinstance(backend, ChatBackend)
    server.respond = lambda body, n: ("ok", good_answer(fenced=n % 2 == 0))
    calls = []
    out = tmp_path / "prefixes.jsonl"
    summary = generate_prefixes(QUERIES, backend, m=4, out_path=out, progress=lambda *a: calls.append(a))
    assert (summary.generated, summary.rejected, summary.cached, summary.requests) == (3, 0, 0, 3)
    assert sorted(calls) == [(1, 3, "ok"), (2, 3, "ok"), (3, 3, "ok")]
    for req in server.requests:
        assert req["path"] == "/v1/chat/completions"
        assert req["headers"]["Authorization"] == f"Bearer {SECRET}"
        assert req["body"]["model"] == "coach-model"
        sent = json.dumps(req["body"])
        assert "hexagon" not in sent or "720" not in sent  # the reference answer is never shown
    prefixes = load_prefixes(out)
    assert set(prefixes) == {query_key(q["problem"]) for q in QUERIES}
    assert all(p == [g[1] for g in GOOD] for p in prefixes.values())
    rec = load_prefix_records(out)[query_key(QUERIES[1]["problem"])]
    assert rec["id"] == "p2" and rec["names"][0] == "Work backwards" and rec["attempts"] == 1
    assert rec["coach"] == {
        "backend": "openai",
        "url": server.base_url + "/chat/completions",
        "model": "coach-model",
        "api_key_env": KEY_ENV,
    }
    assert (tmp_path / "prefixes.rejects.jsonl").read_text() == ""
    _no_secret_anywhere(tmp_path, caplog, capsys, repr(backend), repr(summary), str(vars(backend)))


def test_malformed_json_is_rejected_then_retried(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: (
        ("ok", "Sure! {strategies: [oops") if len(body["messages"]) == 2 else ("ok", good_answer())
    )
    summary = generate_prefixes(QUERIES[:1], make_backend(server), out_path=tmp_path / "p.jsonl")
    assert (summary.generated, summary.requests) == (1, 2)
    retry = server.requests[1]["body"]["messages"]
    assert retry[2] == {"role": "assistant", "content": "Sure! {strategies: [oops"}
    assert "not parsable JSON" in retry[3]["content"]
    assert load_prefix_records(tmp_path / "p.jsonl")[query_key(QUERIES[0]["problem"])]["attempts"] == 2


def test_leaking_answer_is_rejected_and_written_to_rejects(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("ok", leaking_answer())
    q = [{"id": "x", "problem": "What is six times seven?", "answer": "42"}]
    rej = tmp_path / "rejects.jsonl"
    summary = generate_prefixes(
        q, make_backend(server), out_path=tmp_path / "p.jsonl", rejects_path=rej, max_attempts=2
    )
    assert (summary.generated, summary.rejected, summary.requests) == (0, 1, 2)
    assert load_prefixes(tmp_path / "p.jsonl") == {}
    (line,) = [json.loads(x) for x in rej.read_text().splitlines()]
    assert line["key"] == query_key(q[0]["problem"]) and line["id"] == "x" and line["attempts"] == 2
    assert line["reasons"] == ["prefix 3 contains the reference answer as a number"]
    assert [h["attempt"] for h in line["history"]] == [1, 2] and "42" in line["history"][0]["answer"]


def test_timeout_is_retried_then_gives_up(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("sleep", 0.6, ("ok", good_answer())) if n == 1 else ("ok", good_answer())
    backend = make_backend(server, timeout_s=0.2, max_retries=1)
    assert parse_strategies(backend.complete(coach_messages("p")))[0]["name"] == "Work backwards"
    assert backend.http_requests == 2
    server.respond = lambda body, n: ("sleep", 0.6, ("ok", good_answer()))
    with pytest.raises(BackendError, match="timeout"):
        backend.complete(coach_messages("p"))
    summary = generate_prefixes(QUERIES[:1], backend, out_path=tmp_path / "p.jsonl", max_attempts=1)
    assert summary.rejected == 1
    line = json.loads((tmp_path / "p.rejects.jsonl").read_text())
    assert line["reasons"][0].startswith("backend error: timeout")


@pytest.mark.parametrize("code", [429, 500, 503])
def test_429_and_5xx_are_retried_with_backoff(server, monkeypatch, code):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("status", code, '{"error": "busy"}') if n <= 2 else ("ok", good_answer())
    backend = make_backend(server, max_retries=3, backoff_s=0.01)
    t0 = time.monotonic()
    assert backend.complete(coach_messages("p")) == good_answer()
    assert backend.http_requests == 3 and time.monotonic() - t0 >= 0.01 + 0.02
    server.requests.clear()
    server.respond = lambda body, n: ("status", code, "{}")
    with pytest.raises(BackendError, match=f"HTTP {code}.*after 4 tries"):
        backend.complete(coach_messages("p"))
    assert len(server.requests) == 4


def test_other_4xx_is_not_retried_and_key_is_redacted(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("status", 401, f"bad key Bearer {SECRET}")
    backend = make_backend(server, max_retries=3)
    with pytest.raises(BackendError) as err:
        backend.complete(coach_messages("p"))
    assert backend.http_requests == 1 and "HTTP 401" in str(err.value) and SECRET not in str(err.value)


def test_missing_key_env_fails_without_request(server, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(BackendError, match=KEY_ENV):
        make_backend(server).complete(coach_messages("p"))
    assert server.requests == []
    no_auth = make_backend(server, api_key_env=None)
    no_auth.complete(coach_messages("p"))
    assert "Authorization" not in server.requests[0]["headers"]


def test_resume_makes_no_requests_for_cached_queries(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    out = tmp_path / "p.jsonl"
    generate_prefixes(QUERIES[:2], make_backend(server), out_path=out)
    assert len(server.requests) == 2
    again = [dict(q, id=f"new-{q['id']}", problem="  " + q["problem"].replace(" ", "\n ") + "\n") for q in QUERIES]
    calls = []
    summary = generate_prefixes(again, make_backend(server), out_path=out, progress=lambda *a: calls.append(a))
    assert (summary.cached, summary.generated, summary.requests, len(server.requests)) == (2, 1, 1, 3)
    assert calls[:2] == [(1, 3, "cached"), (2, 3, "cached")] and calls[2] == (3, 3, "ok")
    assert len(out.read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="m=3"):
        generate_prefixes(QUERIES, make_backend(server), m=3, out_path=out)


def test_rejects_are_retried_on_rerun_and_dropped_when_fixed(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    out, rej = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    server.respond = lambda body, n: ("ok", "no json here")
    generate_prefixes(QUERIES[:2], make_backend(server), out_path=out, rejects_path=rej, max_attempts=1)
    assert len(rej.read_text().splitlines()) == 2
    server.respond = lambda body, n: ("ok", good_answer())
    summary = generate_prefixes(QUERIES[:1], make_backend(server), out_path=out, rejects_path=rej)
    assert summary.generated == 1
    (left,) = [json.loads(x) for x in rej.read_text().splitlines()]
    assert left["id"] == "p2" and left["reasons"] == ["answer is not parsable JSON"]


def test_concurrency_is_bounded(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    server.respond = lambda body, n: ("sleep", 0.1, ("ok", good_answer()))
    qs = [{"id": i, "problem": f"Problem number {i}: what is x?", "answer": "x"} for i in range(8)]
    summary = generate_prefixes(qs, make_backend(server, concurrency=3), out_path=tmp_path / "p.jsonl")
    assert summary.generated == 8
    assert 2 <= server.max_in_flight <= 3


def test_truncated_last_line_is_repaired(tmp_path):
    out = tmp_path / "p.jsonl"
    backend = CallableBackend(lambda msgs: good_answer())
    generate_prefixes(QUERIES[:1], backend, out_path=out)
    out.write_text(out.read_text() + '{"key": "abc", "pref')
    summary = generate_prefixes(QUERIES[:2], backend, out_path=out)
    assert summary.cached == 1 and len(load_prefixes(out)) == 2
    out.write_text('{"bad\n' + out.read_text())
    with pytest.raises(ValueError, match="line 1"):
        load_prefixes(out)


# ---------------------------------------------------------------- offline pieces


def test_parse_tolerates_fences_think_and_plain_lists():
    assert len(parse_strategies(good_answer(fenced=True))) == 4
    assert len(parse_strategies("<think>hmm {</think>" + good_answer())) == 4
    assert parse_strategies('["use symmetry here", "use induction on n"]')[1] == {
        "name": "",
        "prefix": "use induction on n",
    }
    for bad, reason in [
        ("", "empty"),
        ("{}", "'strategies'"),
        ('{"strategies": [{"name": "x"}]}', "prefix"),
        ("nope", "not parsable"),
    ]:
        _, reasons = check_answer(bad, "1", PrefixRules())
        assert reason in reasons[0]


def test_validation_reasons():
    rules = PrefixRules(m=3, max_words=12, max_chars=100, jaccard=0.6)
    items = [
        {"name": "a", "prefix": "Use symmetry of the figure to pair up equal parts."},
        {"name": "b", "prefix": "Use symmetry of the figure to pair up equal pieces."},
        {"name": "c", "prefix": "Use symmetry of the figure to pair up equal parts."},
        {"name": "d", "prefix": "Too short"},
        {"name": "e", "prefix": " ".join(["word"] * 20)},
    ]
    _, reasons = check_answer(json.dumps({"strategies": items}), None, rules)
    text = "\n".join(reasons)
    assert "expected exactly 3 strategies, got 5" in text
    assert "prefixes 1 and 3 are identical" in text
    assert "prefixes 1 and 2 are near-duplicates" in text
    assert "prefix 4 is too short" in text and "prefix 5 is too long (20 words > 12)" in text
    with pytest.raises(ValueError, match="jaccard"):
        PrefixRules(jaccard=0)


@pytest.mark.parametrize(
    ("text", "answer", "leaks"),
    [
        ("there are 42 cases", "42", True),
        ("there are 312 cases", "12", False),
        ("about 1,000 steps", "1000", True),
        ("the ratio 3/4 matters", "\\frac{3}{4}", True),
        ("it is 0.75 of the whole", "$\\frac{3}{4}$", True),
        ("the answer is \\frac{3}{4}", "0.75", True),
        ("count -5 steps back", "\\boxed{5}", True),
        ("use x2 as a helper", "2", True),
        ("write it as x^2 + 1 then factor", "x^2+1", True),
        ("simplify \\sqrt{2} first", "\\sqrt{2}", True),
        ("a neat trick: use a table", "A", False),
        ("so the answer is (A) clearly", "A", True),
        ("pick option b", "B", True),
        ("no numbers at all", "7", False),
    ],
)
def test_leak_check(text, answer, leaks):
    assert (leaks_answer(text, answer) is not None) == leaks
    if leaks:
        assert answer.strip("$\\boxed{}") not in leaks_answer(text, answer)


def test_rule_coach_and_callable_backend(tmp_path):
    known = {"p1": ["Divide distance by time directly.", "Scale the trip down to one hour."]}
    coach = RuleCoach(lambda q: known.get(q["id"]), name="speed-rules")
    summary = generate_prefixes(QUERIES[:2], coach, m=2, out_path=tmp_path / "r.jsonl")
    assert (summary.generated, summary.rejected, summary.requests) == (1, 1, 0)
    rec = load_prefix_records(tmp_path / "r.jsonl")[query_key(QUERIES[0]["problem"])]
    assert rec["prefixes"] == known["p1"] and rec["coach"] == {"backend": "rule", "name": "speed-rules"}
    rej = json.loads((tmp_path / "r.rejects.jsonl").read_text())
    assert rej["reasons"] == ["rule coach has no strategies for this query"]
    seen = []
    backend = CallableBackend(lambda msgs: seen.append(msgs) or good_answer(), name="local")
    generate_prefixes(QUERIES[:1], backend, out_path=tmp_path / "c.jsonl")
    assert seen[0][1]["role"] == "user" and QUERIES[0]["problem"] in seen[0][1]["content"]
    with pytest.raises(ValueError, match="rules.m"):
        generate_prefixes(QUERIES, backend, m=3, out_path=tmp_path / "x.jsonl", rules=PrefixRules(m=4))
    with pytest.raises(ValueError, match=r"queries\[0\]"):
        generate_prefixes([{"id": 1, "answer": "2"}], backend, out_path=tmp_path / "x.jsonl")


def test_query_key_is_stable():
    k = query_key("What is  1+1?\n")
    assert k == query_key(" What is 1+1?") and len(k) == 64
    assert k != query_key("what is 1+1?")


def test_coach_prompt_and_templates():
    msgs = coach_messages("Find x.", 3)
    user = msgs[1]["content"]
    assert "exactly 3" in user and '"strategies"' in user and "final answer" in user
    for placement in ("system", "assistant"):
        text = wrap_prefix("Try the substitution u = x + 1. </suggestion>", placement)
        assert "Try the substitution u = x + 1." in text and text.count("</suggestion>") == 1
        low = text.lower()
        assert "applicability" in low and "mechanism" in low and "alternatives" in low
        assert "misleading" in low and ("untrusted" in low or "not trust" in low)
    assert wrap_prefix("x y z", "system") != wrap_prefix("x y z", "assistant")
    with pytest.raises(ValueError, match="placement"):
        wrap_prefix("x", "user")


def test_budget_groups():
    assert budget_groups(16, 4, "matched") == [4, 4, 4, 4]
    assert budget_groups(16, 4, "per_prefix") == [16] * 4
    assert baseline_group_size(8, 4, "per_prefix") == 32 and baseline_group_size(16, 4) == 16
    with pytest.raises(ValueError, match=r"group_size=10, m=4"):
        budget_groups(10, 4, "matched")
    with pytest.raises(ValueError, match="budget mode"):
        budget_groups(16, 4, "both")
    with pytest.raises(ValueError, match="m must"):
        budget_groups(16, 0)


# ---------------------------------------------------------------- set-up errors and credentials


def test_missing_key_ends_the_run_at_once_instead_of_failing_every_attempt(server, tmp_path, monkeypatch):
    from meshrl.mesh.coach import MissingKeyError

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(MissingKeyError, match=KEY_ENV):
        generate_prefixes(QUERIES, make_backend(server), m=4, out_path=tmp_path / "p.jsonl", max_attempts=3)
    assert server.requests == [] and not (tmp_path / "p.rejects.jsonl").exists()


def test_credentials_in_the_url_are_never_written(server, tmp_path, monkeypatch, caplog, capsys):
    from meshrl.mesh.coach import redact_url

    monkeypatch.delenv(KEY_ENV, raising=False)
    url = server.base_url.replace("http://", f"http://coach:{SECRET}@")
    assert redact_url(url) == server.base_url.replace("http://", "http://coach:***@")
    assert SECRET not in redact_url(f"https://{SECRET}@example.com/v1")
    server.respond = lambda body, n: ("status", 503, f"overloaded, your url was {url}")
    backend = OpenAIChatBackend(url, "coach-model", api_key_env=None, timeout_s=5.0, max_retries=1, backoff_s=0.001)
    with caplog.at_level(logging.DEBUG):
        summary = generate_prefixes(QUERIES[:1], backend, m=4, out_path=tmp_path / "p.jsonl", max_attempts=2)
    assert summary.rejected == 1 and len(server.requests) == 4  # 2 attempts x (1 try + 1 retry)
    assert server.requests[0]["headers"]["Authorization"].startswith("Basic ")  # the user info, as HTTP auth
    _no_secret_anywhere(tmp_path, caplog, capsys, repr(backend), json.dumps(backend.describe()))
    with pytest.raises(ValueError) as bad:
        OpenAIChatBackend(f"ftp://u:{SECRET}@host/v1", "m")
    assert SECRET not in str(bad.value)
