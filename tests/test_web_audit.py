"""The web page as a person uses it, in headless Chromium (the fixtures and helpers of
tests/test_web.py): a long streamed answer drawn once a frame, "New chat" while a reply runs or waits in the queue,
the settings kept across a reload, and the header after the server is restarted with other flags.
What the page sends is recorded by wrapping its `fetch`, and compared with what the user did."""

from __future__ import annotations

import json
import threading

import httpx

from test_web import (  # noqa: F401  (browser is a fixture)
    TIMEOUT, By, Keys, Server, browser, chat, metrics, online, set_field, wait,
)

# Records the body of every chat request the page sends, and any promise the page's scripts let
# fail unhandled. Installed after each page load.
RECORD = """
window.sentChats = []; window.pageErrors = [];
window.addEventListener('unhandledrejection', (e) => window.pageErrors.push(String(e.reason)));
window.addEventListener('error', (e) => window.pageErrors.push(String(e.message)));
const realFetch = window.fetch;
window.fetch = (url, options = {}) => {
  if (String(url).includes('chat/completions')) window.sentChats.push(JSON.parse(options.body));
  return realFetch(url, options);
};
"""


def load(driver, server: Server) -> None:
    driver.get(server.url)
    wait(driver, online, "the page never connected to /cache/events")
    driver.execute_script(RECORD)


def sent(driver) -> list[dict]:
    return driver.execute_script("return window.sentChats")


def type_message(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies(driver) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))


# Counts, from now on, the animation frames the page is given and the times the reply being
# written is drawn (a text set on it: one mutation record each).
COUNT_DRAWS = """
window.frames_ = 0; window.draws = 0;
const tick = () => { window.frames_++; requestAnimationFrame(tick); };
requestAnimationFrame(tick);
new MutationObserver((records) => {
  for (const r of records) if (r.target.closest && r.target.closest('.msg.assistant')) window.draws++;
}).observe(document.getElementById('messages'), {childList: true, characterData: true, subtree: true});
"""


def test_a_long_answer_is_drawn_once_a_frame_at_most(browser):
    """Drawing (and scrolling to) the whole reply again for every piece made a long answer
    quadratic: 4000 tokens took the page about four times as long as a plain client took to read
    the same stream, its scripts blocked meanwhile. The reply is drawn at most once a frame, and
    what is shown is the stream a plain client reads."""
    server = Server("-c", "4096")
    try:
        load(browser, server)
        n, prompt = 1500, "def add(a, b):"
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", str(n))
        browser.execute_script(COUNT_DRAWS)
        reply = chat(browser, prompt)
        frames, draws = browser.execute_script("return [window.frames_, window.draws]")
        assert reply["predicted-n"] == n and reply["finish"] == "length"
        # One draw a frame, and the reply's bubble, its last draw and its timings line besides.
        assert 0 < draws <= frames + 4, f"{draws} draws in {frames} frames for {n} tokens"
        body = {**sent(browser)[-1], "cache_prompt": False}
        assert body["messages"] == [{"role": "user", "content": prompt}] and body["max_tokens"] == n
        text = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        assert reply["text"] == "".join(text)
        assert browser.execute_script("return window.pageErrors") == []
    finally:
        server.stop()


def test_new_chat_while_a_reply_runs_or_waits_starts_clean(browser):
    """"New chat" during a reply aborted it, but the aborted turn then joined the new conversation's
    history (and was sent with the next message); clicked while the request waited in the queue,
    the old message came back into the message box and the page threw a TypeError."""
    server = Server("-c", "4096")
    try:
        load(browser, server)
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "3000")

        # Mid-stream: wait for text, then start over.
        type_message(browser, "def add(a, b):")
        wait(browser, lambda d: d.execute_script(
            "const m = document.querySelector('.msg.assistant[data-done=\"false\"] .text');"
            "return m !== null && m.textContent.length > 0"), "no text streamed")
        aborted = metrics(server, None)["requests_aborted"]
        browser.find_element(By.ID, "clear").click()
        wait(browser, lambda d: metrics(server, None)["requests_aborted"] == aborted + 1, "the server did not stop")
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == ""
        assert browser.find_elements(By.CSS_SELECTOR, "#messages > *") == []

        set_field(browser, "max_tokens", "4")
        chat(browser, "hello")
        assert sent(browser)[-1]["messages"] == [{"role": "user", "content": "hello"}]

        # Queued: another client holds the worker; the page's request waits, then "New chat".
        browser.find_element(By.ID, "clear").click()
        done = threading.Event()

        def hold() -> None:
            try:
                httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
                    "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "cache_prompt": False})
            finally:
                done.set()

        threading.Thread(target=hold, daemon=True).start()
        wait(browser, lambda d: metrics(server, None)["requests_processing"] == 1, "the other request did not start")
        type_message(browser, "queued message")
        wait(browser, lambda d: metrics(server, None)["requests_deferred"] == 1, "the page's request was not queued")
        browser.find_element(By.ID, "clear").click()
        wait(browser, lambda d: metrics(server, None)["requests_deferred"] == 0, "the queued request was not dropped")
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled(), "the page did not finish the reply")
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == ""
        assert browser.find_elements(By.CSS_SELECTOR, "#messages > *") == []
        done.wait(TIMEOUT)

        chat(browser, "after the queue")
        assert sent(browser)[-1]["messages"] == [{"role": "user", "content": "after the queue"}]
        assert browser.execute_script("return window.pageErrors") == []
    finally:
        server.stop()


def test_settings_survive_a_reload_while_still_being_edited(browser):
    """Settings were saved only on "change", which a field fires when it loses focus: a value
    typed and followed by a reload (or a closed tab) was lost. The docs say they are kept."""
    server = Server()
    try:
        load(browser, server)
        browser.execute_script("localStorage.clear()")
        set_field(browser, "max_tokens", "5")
        set_field(browser, "system", "Answer in French.")  # the focus stays in this field
        browser.refresh()
        wait(browser, online, "the page never reconnected after the reload")
        browser.execute_script(RECORD)
        assert browser.find_element(By.ID, "system").get_attribute("value") == "Answer in French."
        assert browser.find_element(By.ID, "max_tokens").get_attribute("value") == "5"
        chat(browser, "hello")
        assert sent(browser)[-1]["messages"] == [{"role": "system", "content": "Answer in French."},
                                                 {"role": "user", "content": "hello"}]
        assert sent(browser)[-1]["max_tokens"] == 5
    finally:
        browser.execute_script("localStorage.clear()")
        server.stop()


def test_header_follows_a_server_restarted_with_other_flags(browser):
    """The header (model, context, slots) was read once: after the server came back with other
    flags on the same port, the page reconnected but still showed the old server's figures."""
    server = Server("-c", "512")
    try:
        load(browser, server)
        wait(browser, lambda d: "context 512 tokens · 1 slot(s)" in d.find_element(By.ID, "model").text,
             "the header does not show the first server")
        port = server.port
        server.stop()
        wait(browser, lambda d: not online(d), "the page did not see the server go", timeout=20)
        server = Server("-c", "1024", "-np", "2", port=port)
        meta = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["meta"]
        want = f"context {meta['n_ctx']} tokens · {meta['n_slots']} slot(s)"
        assert meta["n_slots"] == 2
        wait(browser, online, "the page did not reconnect", timeout=30)
        wait(browser, lambda d: want in d.find_element(By.ID, "model").text,
             f"the header does not show the restarted server ({want})", timeout=15)
    finally:
        server.stop()
