"""Fuzzing the server and the CLI with generated malformed input (seeded, bounded in count and
time, in-process: no socket leaves the machine). For a client's mistake the answer is a 4xx with
OpenAI's error shape, never a 5xx or a traceback, and afterwards the server answers a good request
exactly as it did before."""

from __future__ import annotations

import json
import logging
import random
import time

import pytest

from fastapi.testclient import TestClient

import expertcache
from conftest import build_reference, save_checkpoint, tiny_config
from expertcache.server.app import create_app

CTX = 96
SEED = 20261203
N_REQUESTS = 300
N_CLI = 60
TIME_LIMIT_S = 240  # a bound, far above what the run needs (about a minute on two cores)
KEY = "fuzz-key"

NASTY = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308,
         1e-300, 5e-324, 0.5, -0.0, "NaN", "Infinity", "-Infinity", "", " ", "x" * 3000, "\ud800", "\udfff x",
         "w1 w2", "\x00", "\u202e", [], {}, [[]], [None], [1, 2, 3], [10**25], ["w1"], {"a": {"b": []}},
         {"type": "text"}, [{"type": "image_url", "image_url": {"url": "x"}}]]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n_predict", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo",
          "best_of", "suffix", "tools", "response_format", "ignore_eos", "cache_prompt", "user", "logit_bias"]
# JSON literals Python's encoder cannot write: put in place of these markers after encoding.
RAW = {'"NaN"': "NaN", '"Infinity"': "Infinity", '"-Infinity"': "-Infinity"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=1), tmp_path_factory.mktemp("fuzz") / "m")


def _encode(body) -> bytes:
    text = json.dumps(body)  # ensure_ascii: a lone surrogate travels as its \\udxxx escape
    for k, v in RAW.items():
        text = text.replace(k, v)
    return text.encode()


def _nasty(rng: random.Random):
    v = rng.choice(NASTY)
    if rng.random() < 0.15:  # nest it
        for _ in range(rng.randint(1, 4)):
            v = rng.choice([[v], {"k": v}])
    return v


def _messages(rng: random.Random):
    msgs = [{"role": "user", "content": "w5 w6"}]
    kind = rng.randrange(8)
    if kind == 0:
        msgs[0]["role"] = _nasty(rng)
    elif kind == 1:
        msgs[0]["content"] = _nasty(rng)
    elif kind == 2:
        msgs[0]["content"] = [_nasty(rng)]
    elif kind == 3:
        msgs[0] = _nasty(rng)
    elif kind == 4:
        msgs[0][rng.choice(["name", "tool_calls", "extra"])] = _nasty(rng)
    elif kind == 5:
        del msgs[0]["content"]
    elif kind == 6:
        msgs = [{"role": "assistant", "content": None}] * rng.randint(0, 3)
    else:
        msgs.append({"role": "system", "content": {"text": "w1"}})
    return msgs


def _body(rng: random.Random, chat: bool) -> bytes:
    """A request with one to three fields set to something a careless or hostile client sends,
    or a body broken at the byte level."""
    base = {"max_tokens": 4, "temperature": 0}
    base.update({"messages": [{"role": "user", "content": "w5 w6"}]} if chat else {"prompt": "w5 w6"})
    kind = rng.random()
    if kind < 0.65:
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(FIELDS)
            base[name] = _messages(rng) if name == "messages" and rng.random() < 0.6 else _nasty(rng)
        if base.get("max_tokens") not in (None, 0, 1, 4) and not isinstance(base.get("max_tokens"), bool):
            base.setdefault("stop", "w1")  # a valid but long generation costs time, not coverage
        return _encode(base)
    raw = _encode(base)
    choice = rng.randrange(9)
    if choice == 0:
        return raw[: rng.randrange(len(raw))]  # truncated
    if choice == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if choice == 2:
        d = rng.randint(50, 5000)
        return b'{"prompt": "w1", "x": ' + b"[" * d + b"]" * d + b"}"
    if choice == 3:
        return rng.choice([b"[]", b"null", b"1", b'"w1"', b"true", b"", b"{}", b"{,}", b"\xef\xbb\xbf{}"])
    if choice == 4:
        return raw.replace(b'"w5', b'"w5 \xff\xfe\xc3', 1)  # not UTF-8
    if choice == 5:
        return raw[:-1] + b', "max_tokens": 1' + b"7" * rng.randint(30, 6000) + b"}"
    if choice == 6:
        return raw[:-1] + b', "seed": -' + b"9" * rng.randint(19, 80) + b"}"
    if choice == 7:
        return raw[:-1] + b', "max_tokens": 4, "max_tokens": "four"}'  # duplicate key: the last wins
    return raw.replace(b"w5", b"\\ud83d", 1)  # half a surrogate pair


def _check_error_shape(r) -> None:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


def _good(c: TestClient, headers: dict) -> list[str]:
    """Good requests whose answers must not change: greedy and seeded, streamed and not."""
    out = []
    for body in ({"prompt": "w5 w9 w17", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                 {"messages": [{"role": "user", "content": "w7 w9"}], "max_tokens": 8, "temperature": 0.8,
                  "seed": 11, "ignore_eos": True, "stop": ["w3 w"]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        for stream in (False, True):
            r = c.post(path, json={**body, "stream": stream}, headers=headers)
            assert r.status_code == 200, r.text
            out.append(r.text if stream else json.dumps(r.json()["choices"]))
    return out


def _strip_ids(texts: list[str]) -> list[str]:
    """Answers without what differs between two identical requests (ids, times, timings)."""
    out = []
    for t in texts:
        if t.startswith("["):
            out.append(t)
            continue
        parts = []
        for line in t.splitlines():
            if line.startswith("data: {"):
                e = json.loads(line[6:])
                parts.append(json.dumps({"choices": e.get("choices"), "usage": e.get("usage")}))
        out.append("\n".join(parts))
    return out


def test_fuzz_requests(ckpt, caplog):
    model = expertcache.load(ckpt, ctx_size=CTX)
    rng = random.Random(SEED)
    auth = {"Authorization": f"Bearer {KEY}"}
    caplog.set_level(logging.ERROR)
    with TestClient(create_app(model, n_slots=2, api_key=KEY, max_body_bytes=32 * 1024),
                    raise_server_exceptions=False) as c:
        before = _strip_ids(_good(c, auth))
        t0 = time.monotonic()
        statuses: dict[int, int] = {}
        for i in range(N_REQUESTS):
            assert time.monotonic() - t0 < TIME_LIMIT_S, f"fuzzing ran past {TIME_LIMIT_S}s at request {i}"
            which = rng.random()
            headers = dict(auth)
            if which < 0.05:
                headers["Authorization"] = rng.choice(["", "Bearer", f"bearer {KEY[:-1]}", "Bearer  spaced key", KEY])
            if which < 0.45:
                path, raw = "/v1/chat/completions", _body(rng, chat=True)
            elif which < 0.85:
                path, raw = "/v1/completions", _body(rng, chat=False)
            elif which < 0.92:
                path = rng.choice(["/tokenize", "/detokenize"])
                raw = _encode({rng.choice(["content", "tokens", "with_pieces", "add_special"]): _nasty(rng)})
            else:
                path, raw = rng.choice(["/v1/nothing", "/v1/models/\u2603", "/health/x", "/v1/embeddings"]), b"{}"
            if rng.random() < 0.05:
                raw = raw + b" " * 40_000  # over the body limit
            method = "GET" if path.startswith("/v1/models") else rng.choice(["POST"] * 9 + ["PUT"])
            r = c.request(method, path, content=raw, headers={**headers, "content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:300], r.text[:500])
            if r.status_code >= 400:
                _check_error_shape(r)
            elif "text/event-stream" in r.headers.get("content-type", ""):
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-500:]
        after = _strip_ids(_good(c, auth))
    assert after == before
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # The fuzzer reached the cases it is for: refusals of several kinds, and some valid requests.
    assert statuses.get(400, 0) > N_REQUESTS // 3 and statuses.get(200, 0) > 5
    assert {401, 404, 405, 413} <= set(statuses), statuses


CLI_FLAGS = {
    "--temp": ["nan", "inf", "-1", "1e400", "abc", "1e-300", "-nan", "0x10"],
    "--top-p": ["-0.1", "nan", "1.5", "-inf", "-1e-320"],
    "--min-p": ["nan", "2", "-0.1"],
    "--top-k": ["-1", "1.5", str(2**70)],
    "--seed": [str(2**64), str(-(2**63) - 1), "1e3", "0x1", "9" * 50],
    "-n": ["-1", "many", "1.0"],
    "--device": ["foo", "cuda", "cuda:-1", "cuda:99", "meta", "cpu:1x", "", "mps", "xla"],
    "-c": ["0", "-5", "nan"],
    "--ubatch": ["0", "-1"],
    "--dtype": ["int3", "", "float128"],
    "--cache-mem": ["12 parsecs", "-1GB", "nan"],
    "--stop": ["\udcff"],
    "-t": ["0", "-2"],
}


def test_fuzz_cli(ckpt, capsys):
    from expertcache.cli import main

    rng = random.Random(SEED + 1)
    t0 = time.monotonic()
    for i in range(N_CLI):
        assert time.monotonic() - t0 < TIME_LIMIT_S, f"CLI fuzzing ran past {TIME_LIMIT_S}s at invocation {i}"
        argv = ["run", "-m", str(ckpt), "-p", rng.choice(["w1 w2", "w1 \udcff w2", "w3"]), "-n", "2"]
        for flag in rng.sample(sorted(CLI_FLAGS), rng.randint(1, 2)):
            argv += [flag, rng.choice(CLI_FLAGS[flag])]
        capsys.readouterr()
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "error" in lines[0], (argv, err)
