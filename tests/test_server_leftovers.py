"""Two of the server's request-handling rules against their references. How many tokens a
completion may have: the prompt and the completion together fit the slot's context, as
llama-server (n_predict -1, no context shift) and vLLM count them, whether max_tokens is left out
or larger than what is left (the default stopped one token before an explicit large max_tokens).
The queue's bound: beyond `--max-queue` waiting requests the server answers 503 with
`Retry-After` and an OpenAI-style error at once, and goes on serving. Races are pinned with
Events (a generation held until the test lets it go), never with sleeps."""

from __future__ import annotations

import json
import socket
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import expertcache
from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config, wait_until
from expertcache.engine import GenerationResult
from expertcache.errors import ExpertCacheError
from expertcache.server.app import create_app
from expertcache.server.slots import MAX_QUEUE, Job, QueueFull, Scheduler
from test_server_races import hold_after_first_piece

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
TIMEOUT = 15.0


# ---- how many tokens a completion may have ----
CTX = 16  # the context of a slot on the bundled model: a few tokens of room after a short prompt
PROMPT = "The cat sat"


@pytest.fixture(scope="module")
def bundled():
    model = expertcache.load(ctx_size=CTX)  # the bundled tiny-qwen3-moe
    with TestClient(create_app(model)) as c:
        yield model, c


def _completion(c, body: dict) -> dict:
    r = c.post(CMPL, json={"temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_default_and_explicit_max_tokens_stop_at_the_same_token(bundled):
    model, c = bundled
    p = len(model.tokenizer.encode(PROMPT))
    room = CTX - p  # hand-computed: what the prompt leaves of the context
    assert 0 < room < CTX
    default = _completion(c, {"prompt": PROMPT})
    assert default["usage"]["prompt_tokens"] == p
    assert default["usage"]["completion_tokens"] == room and default["usage"]["total_tokens"] == CTX
    assert default["choices"][0]["finish_reason"] == "length"
    # Every way of asking for "as many as fit" stops at the same token: llama-server's n_predict
    # -1, and a max_tokens (or max_completion_tokens) larger than the room, up to the whole context.
    for limit in ({"n_predict": -1}, {"max_tokens": CTX}, {"max_tokens": room + 1},
                  {"max_completion_tokens": CTX}, {"max_tokens": room}):
        got = _completion(c, {"prompt": PROMPT, **limit})
        assert got["usage"]["completion_tokens"] == room, (limit, got["usage"])
        assert got["usage"]["total_tokens"] == CTX, limit
        assert got["choices"][0]["text"] == default["choices"][0]["text"], limit
        assert got["choices"][0]["finish_reason"] == "length", limit
    smaller = _completion(c, {"prompt": PROMPT, "max_tokens": room - 1})
    assert smaller["usage"]["completion_tokens"] == room - 1
    # The stream stops at the same token too.
    r = c.post(CMPL, json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": CTX, "stream": True,
                           "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == room
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == default["choices"][0]["text"]


def test_chat_completions_fit_the_context_too(bundled):
    model, c = bundled
    messages = [{"role": "user", "content": "hi"}]
    p = len(model.tokenizer.encode_chat(messages))
    assert p < CTX
    for limit in ({}, {"max_tokens": CTX}):
        r = c.post(CHAT, json={"messages": messages, "temperature": 0, "ignore_eos": True, **limit})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": p, "completion_tokens": CTX - p, "total_tokens": CTX,
                                     "prompt_tokens_details": r.json()["usage"]["prompt_tokens_details"]}, limit


def test_a_prompt_that_fills_the_context_leaves_no_room(bundled):
    model, c = bundled
    ids = (model.tokenizer.encode(PROMPT) * CTX)[:CTX]
    # As llama-server and vLLM: a prompt of the whole context cannot be answered (an explicit
    # max_tokens gave one token past the context; none gave an empty 200).
    for limit in ({}, {"max_tokens": 5}, {"n_predict": -1}):
        r = c.post(CMPL, json={"prompt": ids, **limit})
        assert r.status_code == 400, (limit, r.text)
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
        assert f"{CTX} tokens" in err["message"], err
    # max_tokens 0 only processes the prompt (into the slot's prompt cache): there is room for that.
    r = c.post(CMPL, json={"prompt": ids, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["total_tokens"] == CTX
    # One token shorter leaves room for exactly one.
    one = _completion(c, {"prompt": ids[:-1], "max_tokens": 5})
    assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] == "length"


# ---- the queue's bound ----
QCTX = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path_factory.mktemp("queue") / "m")


def count_submits(sched: Scheduler) -> threading.Semaphore:
    """A semaphore released once per job submitted (queued or refused)."""
    submitted, real = threading.Semaphore(0), sched.submit

    def submit(job):
        real(job)
        submitted.release()

    sched.submit = submit
    return submitted


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_full_queue_refuses_with_503_and_the_server_goes_on(ckpt):
    model = expertcache.load(ckpt, ctx_size=QCTX)
    ref = expertcache.load(ckpt, ctx_size=QCTX)
    first, release = hold_after_first_piece(model)
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out: dict[str, httpx.Response] = {}
    app = create_app(model, max_queue=1)
    with TestClient(app) as c:
        sched = app.state.scheduler
        submitted = count_submits(sched)

        def ask(name, prompt):
            out[name] = c.post(CMPL, json={"prompt": prompt, **body})

        running = threading.Thread(target=ask, args=("running", "w1 w2"), daemon=True)
        queued = threading.Thread(target=ask, args=("queued", "w3 w4"), daemon=True)
        try:
            running.start()
            assert submitted.acquire(timeout=TIMEOUT) and first.wait(TIMEOUT), "the first request did not start"
            queued.start()
            assert submitted.acquire(timeout=TIMEOUT), "the second request was not queued"
            assert sched.snapshot().deferred == 1
            # One more would be the second waiting: refused at once, a stream before it begins too.
            for extra in ({}, {"stream": True}):
                r = c.post(CMPL, json={"prompt": "w5 w6", **body, **extra})
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                assert r.headers["content-type"].startswith("application/json")
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "server_overloaded" and err["type"] == "server_error", err
                assert "--max-queue 1" in err["message"], err
            chat = c.post(CHAT, json={"messages": [{"role": "user", "content": "w7"}], **body})
            assert chat.status_code == 503 and chat.json()["error"]["code"] == "server_overloaded"
            # The openai client reads it as OpenAI's own error (retries off: it would wait and retry).
            oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=c, max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                oai.completions.create(model=model.path.name, prompt="w8", max_tokens=2)
            assert e.value.status_code == 503 and e.value.code == "server_overloaded"
            text = c.get("/metrics").text
            assert metric(text, "expertcache_requests_refused_total") == 4
            assert metric(text, "expertcache_requests_deferred_limit") == 1
            assert metric(text, "expertcache_requests_deferred") == 1
            assert c.get("/cache/state").json()["server"]["refused"] == 4  # the web page's counters
            # The refused requests never reached the worker, nor the queue.
            assert sched.snapshot().deferred == 1 and sched.snapshot().requests == 0
        finally:
            release.set()
            running.join(TIMEOUT)
            queued.join(TIMEOUT)
        for name, prompt in (("running", "w1 w2"), ("queued", "w3 w4")):
            assert out[name].status_code == 200, out[name].text
            assert out[name].json()["choices"][0]["text"] == ref.generate(prompt, **body).text, name
        # The server still serves, and the queue takes requests again.
        after = c.post(CMPL, json={"prompt": "w5 w6", **body})
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == ref.generate("w5 w6", **body).text
        s = sched.snapshot()
        assert (s.requests, s.refused, s.deferred) == (3, 4, 0), s


class HeldModel:
    """Just enough of a Model for the scheduler: each generate() waits for `release`; `started`
    is set once the first one began."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def new_session(self):
        return SimpleNamespace(tokens=[], truncate=lambda n: n)

    def generate(self, ids, session=None, on_text=None, should_stop=None, **gen):
        self.started.set()
        assert self.release.wait(TIMEOUT)
        return GenerationResult("", [], len(ids), 0, "length", 0.0, 0.0)


def _job(results: dict, name: str) -> Job:
    done = threading.Event()
    job = Job([1, 2], {"max_tokens": 1})

    def on_done(res, err):
        results[name] = (res, err)
        done.set()

    job.on_done, job.done = on_done, done
    return job


def test_the_bound_counts_clients_still_waiting():
    model = HeldModel()
    sched = Scheduler(model, max_queue=1)
    sched.start()
    results: dict = {}
    jobs = {name: _job(results, name) for name in ("running", "queued", "refused", "after_leave", "over")}
    try:
        sched.submit(jobs["running"])
        assert model.started.wait(TIMEOUT)
        sched.submit(jobs["queued"])
        sched.submit(jobs["refused"])
        assert jobs["refused"].done.is_set(), "a refusal is answered at once"
        res, err = results["refused"]
        assert res is None and isinstance(err, QueueFull) and err.status == 503 and err.retry_after == 1
        # A queued client that left waits for nobody: it does not hold a place.
        jobs["queued"].cancelled.set()
        sched.submit(jobs["after_leave"])
        assert not jobs["after_leave"].done.is_set(), "refused while nobody live was waiting"
        sched.submit(jobs["over"])
        assert isinstance(results["over"][1], QueueFull)
        assert sched.snapshot().refused == 2
    finally:
        model.release.set()
        for name in ("running", "queued", "after_leave"):
            assert jobs[name].done.wait(TIMEOUT), name
        sched.stop()
    assert results["running"][1] is None and results["after_leave"][1] is None
    assert results["queued"] == (None, None)  # dropped unrun


def test_max_queue_zero_runs_one_at_a_time_and_refuses_the_rest():
    model = HeldModel()
    sched = Scheduler(model, max_queue=0)
    sched.start()
    results: dict = {}
    a, b, c = (_job(results, n) for n in "abc")
    try:
        sched.submit(a)  # the worker is idle: none waits, so it is taken
        assert model.started.wait(TIMEOUT)
        sched.submit(b)
        assert isinstance(results["b"][1], QueueFull) and "--max-queue 0" in str(results["b"][1])
        model.release.set()
        assert a.done.wait(TIMEOUT) and results["a"][1] is None
        wait_until(lambda: sched.snapshot().processing == 0, "the worker stayed busy", TIMEOUT)
        sched.submit(c)
        assert c.done.wait(TIMEOUT) and results["c"][1] is None
    finally:
        model.release.set()
        sched.stop()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_scheduler_refuses_a_bad_bound(bad):
    with pytest.raises(ValueError, match="max_queue"):
        Scheduler(HeldModel(), max_queue=bad)


def test_serve_takes_max_queue(ckpt, capsys, monkeypatch):
    from expertcache.cli import build_parser
    from expertcache.commands import serve
    from expertcache.server import app as app_module

    assert build_parser().parse_args(["serve"]).max_queue == MAX_QUEUE == 64
    code, err = run_cli(capsys, "serve", "--max-queue", "-1")
    assert_one_line_error(code, err, "--max-queue", "-1")
    # The flag reaches the app (create_app stops the command before it serves).
    seen, socks = {}, []
    real_listen = serve._listen

    def listen(host, port):
        socks.append(real_listen(host, port))
        return socks[-1]

    def create(model, **kw):
        seen.update(kw)
        raise ExpertCacheError("stopped by the test")

    monkeypatch.setattr(serve, "_listen", listen)
    monkeypatch.setattr(app_module, "create_app", create)
    try:
        code, err = run_cli(capsys, "serve", "-m", str(ckpt), "--port", "0", "--max-queue", "3")
    finally:
        for s in socks:
            s.close()
    assert code == 2 and "stopped by the test" in err
    assert seen["max_queue"] == 3
    assert isinstance(socks[0], socket.socket)


def test_serve_frees_its_port_when_the_model_fails_to_load(capsys, monkeypatch, tmp_path):
    """The port is taken before the load (a busy one fails fast); a load that fails gives it back."""
    from expertcache.commands import serve

    socks = []
    real_listen = serve._listen
    monkeypatch.setattr(serve, "_listen", lambda host, port: socks.append(real_listen(host, port)) or socks[-1])
    code, err = run_cli(capsys, "serve", "-m", str(tmp_path / "nope"), "--port", "0")
    assert_one_line_error(code, err, "nope")
    assert len(socks) == 1 and socks[0].fileno() == -1
