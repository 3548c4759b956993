"""The request formats of the OpenAI-compatible API against OpenAI's reference, llama-server's and
vLLM's documented values, and the `openai` client: bodies that are not UTF-8, OpenAI's `developer`
role, the "no limit" / "off" values of llama-server's `n_predict` and vLLM's `top_k`, every
max-tokens alias checked, `stream_options` checked like every other field, and errors that say
what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

import expertcache
from conftest import LiveServer, build_reference, save_checkpoint, tiny_config
from expertcache.server import protocol as P
from expertcache.server.app import create_app

CTX = 48
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path_factory.mktemp("proto") / "m")


@pytest.fixture(scope="module")
def client(ckpt):
    with TestClient(create_app(expertcache.load(ckpt, ctx_size=CTX))) as c:
        yield c


def sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


BODY = {"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}


# ---- the body's bytes ----
@pytest.mark.parametrize("raw", [
    # UTF-8's bytes for a surrogate (CESU-8): not UTF-8 (RFC 3629), and json.loads would have
    # read them as a lone surrogate, past the check that refuses "\ud800".
    json.dumps({**BODY, "stop": ["\ud800"]}, ensure_ascii=False).encode("utf-8", "surrogatepass"),
    json.dumps({**BODY, "user": "u\udfffu"}, ensure_ascii=False).encode("utf-8", "surrogatepass"),
    # UTF-16 and UTF-32, which json.loads(bytes) detects and reads.
    json.dumps(BODY).encode("utf-16"),
    json.dumps(BODY).encode("utf-32"),
])
def test_a_body_that_is_not_utf8_is_400_invalid_json(client, raw):
    """docs/server.md: "bytes that are not UTF-8" are 400 `invalid_json`; a lone surrogate is a
    400 however it was written (the escaped "\\ud800" already was)."""
    for path in (CMPL, "/tokenize"):
        err = error_of(client.post(path, content=raw, headers={"content-type": "application/json"}))
        assert err["code"] == "invalid_json" and "not valid UTF-8" in err["message"], err
    # The same stop string escaped: refused too, naming the field (as before).
    err = error_of(client.post(CMPL, content=json.dumps({**BODY, "stop": ["\ud800"]}).encode()))
    assert err["param"] == "stop"
    # RFC 8259 lets a parser ignore a UTF-8 byte order mark; json.loads(bytes) did, and still does.
    plain = client.post(CMPL, json=BODY).json()["choices"][0]["text"]
    r = client.post(CMPL, content=b"\xef\xbb\xbf" + json.dumps(BODY).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain


# ---- OpenAI's developer role ----
@pytest.fixture(scope="module")
def live(ckpt):
    """A real server through the openai client, whose chat template is set per test."""
    model = expertcache.load(ckpt, ctx_size=CTX)
    srv = LiveServer(create_app(model))
    srv.model = model
    srv.oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    yield srv
    srv.stop()


def _use_template(model, name: str) -> None:
    model.tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    model.tokenizer._compiled = None


@pytest.mark.parametrize("template", ["qwen3", "qwen3_5"])
def test_a_developer_message_is_the_system_message_for_a_template_without_that_role(live, template):
    """OpenAI's `developer` role is its newer name for the system instructions; llama-server maps
    it to `system` for templates that do not know it (ggml-org/llama.cpp#20215). Qwen3's template
    dropped the message without a word (the model never saw the instructions), Qwen3.5's refused it."""
    _use_template(live.model, template)

    def ask(messages, stream=False):
        kw = dict(model=live.model.path.name, messages=messages, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True})
        if not stream:
            r = live.oai.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage.prompt_tokens
        chunks = list(live.oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.prompt_tokens

    user = {"role": "user", "content": "w5 w9"}
    as_system = ask([{"role": "system", "content": "w3 w4 w8 w11"}, user])
    alone = ask([user])
    assert as_system[1] > alone[1]  # the instructions are in the prompt
    for stream in (False, True):
        assert ask([{"role": "developer", "content": "w3 w4 w8 w11"}, user], stream) == as_system


def test_a_template_that_knows_the_developer_role_gets_it_as_it_is():
    """Gemma 4's template names `developer` (and renders it as its system turn): nothing to map."""
    assert P.knows_developer((TEMPLATES / "gemma4.jinja").read_text())
    assert not P.knows_developer((TEMPLATES / "qwen3.jinja").read_text())
    assert not P.knows_developer(None)
    body = {"messages": [{"role": "developer", "content": "w3"}, {"role": "user", "content": "w5"}]}
    assert P.chat_messages(body, developer=True)[0]["role"] == "developer"
    assert P.chat_messages(body, developer=False)[0] == {"role": "system", "content": "w3"}


# ---- llama-server's and vLLM's "no limit" / "off" values ----
def test_n_predict_minus_one_is_llama_servers_no_limit(client):
    """llama-server's `n_predict` is -1 by default: no limit (here: the end of the slot's context)."""
    body = {"prompt": "w1 w2 w3", "temperature": 0, "ignore_eos": True}
    unlimited = client.post(CMPL, json=body).json()
    r = client.post(CMPL, json={**body, "n_predict": -1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == unlimited["choices"] and r.json()["usage"] == {
        **unlimited["usage"], "prompt_tokens_details": r.json()["usage"]["prompt_tokens_details"]}
    assert unlimited["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] > 2 * CTX // 3
    # A limit given beside it is the limit (the first of max_completion_tokens, max_tokens,
    # n_predict); -2 and a -1 max_tokens are not values of anyone's API.
    for fields, n in (({"n_predict": -1, "max_tokens": 2}, 2), ({"max_tokens": 5, "n_predict": 7}, 5),
                      ({"max_completion_tokens": 3, "max_tokens": 5, "n_predict": -1}, 3)):
        assert client.post(CMPL, json={**body, **fields}).json()["usage"]["completion_tokens"] == n
    for name in ("n_predict", "max_tokens", "max_completion_tokens"):
        value = -2 if name == "n_predict" else -1
        assert error_of(client.post(CMPL, json={**body, name: value}))["param"] == name


def test_top_k_minus_one_is_off_as_in_vllm_and_llama_server(client):
    body = {"prompt": "w1 w2", "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    want = client.post(CMPL, json=body).json()["choices"][0]["text"]
    assert client.post(CMPL, json={**body, "top_k": 0}).json()["choices"][0]["text"] == want
    r = client.post(CMPL, json={**body, "top_k": -1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    err = error_of(client.post(CMPL, json={**body, "top_k": -2}))
    assert err["param"] == "top_k" and ">= -1" in err["message"]


# ---- every field checked ----
@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": "x", "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 5, "n_predict": 1.5}, "n_predict"),
    ({"max_completion_tokens": 5, "max_tokens": 10**6}, "max_tokens"),
])
def test_every_max_tokens_alias_given_is_checked(client, fields, param):
    """A wrong value was let through when another alias came first in the precedence."""
    for path, prompt in ((CMPL, {"prompt": "w1"}), (CHAT, {"messages": [{"role": "user", "content": "w1"}]})):
        assert error_of(client.post(path, json={**prompt, **fields}))["param"] == param


def test_stream_options_are_checked_like_every_other_field(client):
    """An option that would change the stream and is not honoured (vLLM's
    `continuous_usage_stats`, a usage in every chunk) is refused by name, not ignored; OpenAI's
    `include_obfuscation` changes no content and is accepted; a wrong type names `stream_options`."""
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "temperature": 0, "stream": True}
    err = error_of(client.post(CHAT, json={**body, "stream_options": {"include_usage": True,
                                                                        "continuous_usage_stats": True}}))
    assert err["param"] == "stream_options" and err["code"] == "unsupported_parameter"
    assert "continuous_usage_stats" in err["message"]
    err = error_of(client.post(CHAT, json={**body, "stream_options": {"include_usage": "yes"}}))
    assert err["param"] == "stream_options" and "include_usage" in err["message"] and err["code"] is None

    def text(events):
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])

    plain = sse(client.post(CHAT, json=body).text)
    for opts in ({"include_obfuscation": False}, {"include_obfuscation": True}, {"include_usage": None}):
        r = client.post(CHAT, json={**body, "stream_options": opts})
        assert r.status_code == 200, (opts, r.text)
        assert text(sse(r.text)) == text(plain)


# ---- errors that say what is wrong ----
def test_response_format_of_the_wrong_type_is_a_type_error(client):
    base = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    err = error_of(client.post(CHAT, json={**base, "response_format": "json_object"}))
    assert err["param"] == "response_format" and err["code"] is None and "must be an object" in err["message"]
    err = error_of(client.post(CHAT, json={**base, "response_format": {"type": "json_object"}}))
    assert err["code"] == "unsupported_parameter" and "json_object" in err["message"]


@pytest.mark.parametrize("prompt,needle", [
    ([["w1"]], "holds string 'w1'"),     # one prompt: an array of token ids holding a string
    ([[[5, 6]]], "holds array [5, 6]"),
    ([5, 6.5], "holds number 6.5"),
])
def test_a_prompt_that_is_not_token_ids_names_what_it_holds(client, prompt, needle):
    """One prompt of the wrong shape was "holds 1 prompts; this server takes one prompt per request"."""
    err = error_of(client.post(CMPL, json={"prompt": prompt, "max_tokens": 1}))
    assert err["param"] == "prompt" and needle in err["message"] and "prompts" not in err["message"], err
