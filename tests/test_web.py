"""The server's web page in a real browser: headless Chromium (the system's `chromium` and
`chromedriver`, never downloaded) driven by Selenium against `expertcache serve` on the bundled
model with a quarter of the experts in the cache. A chat goes through the page and streams back;
the page's cache grid must equal /cache/state and its counters must equal /metrics; with an API
key the page asks for it, and when the server goes away the page says so and reconnects when it
is back. Set EXPERTCACHE_WEB_SCREENSHOT=PATH to keep the screenshot of the chat (docs/img/web.png)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import prometheus_client.parser as prometheus_parser
import pytest


CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no Chromium on this machine (chromium and chromedriver not on PATH): install Debian's "
                "'chromium' and 'chromium-driver' packages to run the browser tests", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

START_TIMEOUT = 180.0  # loading the model on a busy 2-core machine
TIMEOUT = 60.0
KEY = "web-test-key-3f9c"
COUNTERS = ("ops_seen", "used_experts_unique", "loaded_experts_before", "resident_hits", "resident_misses",
            "copied_experts", "copied_bytes", "copy_ranges", "skipped_experts", "skipped_bytes",
            "empty_copy_ops", "evictions", "waves")


class Server:
    """`expertcache serve` in a subprocess on a loopback port (a free one unless `port` is given)."""

    def __init__(self, *flags: str, port: int = 0):
        cmd = [sys.executable, "-m", "expertcache.cli", "serve", "--cache-fraction", "0.25", "-c", "1024",
               "-t", "1", "--host", "127.0.0.1", "--port", str(port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT) or not self.url:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.port = int(self.url.rsplit(":", 1)[1])

    def _read(self) -> None:
        for line in self.proc.stderr:  # drained to the end, so the server never blocks on a full pipe
            self.lines.append(line)
            m = re.search(r" on (http://127\.0\.0\.1:\d+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=TIMEOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,900", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def wait(driver, condition, what: str, timeout: float = TIMEOUT):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def online(driver) -> bool:
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-online") == "true"


def page_resident(driver) -> set[tuple[int, int]]:
    cells = driver.execute_script(
        "return [...document.querySelectorAll('#grid .cell.r')].map(c => [+c.dataset.layer, +c.dataset.expert])")
    return {(a, b) for a, b in cells}


def state_resident(state: dict) -> set[tuple[int, int]]:
    return {(int(layer), e) for layer, ids in state["resident"].items() for e in ids}


def page_value(driver, list_id: str, key: str) -> str | None:
    return driver.execute_script(
        f"const d = document.querySelector('#{list_id} dd[data-key=\"' + arguments[0] + '\"]');"
        "return d ? d.dataset.value : null", key)


def metrics(server: Server, key: str | None) -> dict[str, float]:
    """/metrics as {name: value}: per-layer cache counters summed over layers, labelled series by label."""
    out: dict[str, float] = {}
    for fam in prometheus_parser.text_string_to_metric_families(server.get("/metrics", key).text):
        for s in fam.samples:
            if s.name.startswith("expertcache_cache_invalidations"):
                out[f"invalidations:{s.labels['reason']}"] = s.value
            elif s.name == "expertcache_cache_info":
                out.update({f"info:{k}": v for k, v in s.labels.items()})
            else:
                name = s.name.removeprefix("expertcache_").removeprefix("cache_").removesuffix("_total")
                out[name] = out.get(name, 0) + s.value
    return out


def set_field(driver, field_id: str, value: str) -> None:
    if field_id in ("temperature", "top_p", "max_tokens", "system", "stop_strings") and \
            driver.find_element(By.ID, "settings").get_attribute("open") is None:
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    el = driver.find_element(By.ID, field_id)
    el.clear()
    el.send_keys(value)


def chat(driver, text: str) -> dict:
    """Send `text` through the page and wait for the streamed reply; its text and timings."""
    n = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='true']")) > n,
         f"no finished reply to {text!r}")
    reply = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert reply.get_attribute("data-error") is None, reply.text
    stats = reply.find_element(By.CLASS_NAME, "stats")
    return {"text": driver.execute_script("return arguments[0].querySelector('.text').textContent", reply),
            "finish": reply.get_attribute("data-finish"),
            **{k: int(stats.get_attribute(f"data-{k}")) for k in ("prompt-n", "cache-n", "predicted-n")}}


def check_counters(driver, server: Server, key: str | None) -> dict:
    """The page shows the same counters as /metrics (read while the server is idle)."""
    want = metrics(server, key)
    assert want["requests_processing"] == 0 and want["requests_deferred"] == 0

    def shown() -> dict:
        got = {name: page_value(driver, "counters", name) for name in COUNTERS}
        got["hit_rate"] = page_value(driver, "counters", "hit_rate")
        for reason in ("source", "dtype", "shape", "expert_count", "pool"):
            got[f"invalidations:{reason}"] = page_value(driver, "invalidations", reason)
        return got

    def same(d) -> bool:
        got = shown()
        return (all(got[n] is not None and int(got[n]) == want[n] for n in COUNTERS)
                and all(int(got[k]) == want[k] for k in got if k.startswith("invalidations:"))
                and got["hit_rate"] is not None and float(got["hit_rate"]) == pytest.approx(want["hit_rate"], rel=1e-12))

    try:
        wait(driver, same, "the page's counters never matched /metrics", timeout=15)
    except Exception:
        pytest.fail(f"page {shown()} != /metrics {want}")
    info = {k: driver.find_element(By.ID, k).get_attribute("data-value") for k in ("mode", "policy", "store")}
    assert info == {k: want[f"info:{k}"] for k in ("mode", "policy", "store")}
    assert int(driver.find_element(By.ID, "pool").get_attribute("data-capacity")) == want["capacity"]
    return want


def test_chat_streams_and_cache_view_matches_the_server(browser, tmp_path):
    server = Server()
    try:
        browser.get(server.url)
        wait(browser, online, "the page never connected to /cache/events")
        state = server.get("/cache/state", None).json()
        n_cells = len(state["moe_layers"]) * state["num_experts"]
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .cell")) == n_cells, "no grid")
        assert state["mode"] == "cache" and state["capacity"] == state["total_experts"] // 4
        before = page_resident(browser)
        assert before == state_resident(state)
        wait(browser, lambda d: d.find_element(By.ID, "model").get_attribute("data-model") == state["model"],
             "the model's name is not shown")

        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "40")
        first = chat(browser, "def add(a, b):")
        assert first["text"] and first["predicted-n"] > 0 and first["cache-n"] == 0

        # The streamed text is what the API answers in one piece for the same request.
        ref = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 40, "temperature": 0,
            "cache_prompt": False}).json()
        assert first["text"] == ref["choices"][0]["message"]["content"]
        assert first["prompt-n"] + first["cache-n"] == ref["usage"]["prompt_tokens"]

        check_counters(browser, server, None)
        state = server.get("/cache/state", None).json()
        after = page_resident(browser)
        assert after == state_resident(state), "the page's grid is not the server's resident set"
        assert after != before and 0 < len(after) <= state["capacity"]

        second = chat(browser, "Now write sub(a, b).")
        assert second["cache-n"] > 0, "the second turn reused nothing from the prompt cache"
        check_counters(browser, server, None)
        assert page_resident(browser) == state_resident(server.get("/cache/state", None).json())
        assert int(browser.find_element(By.ID, "plot").get_attribute("data-points")) >= 1

        shot = tmp_path / "web.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("EXPERTCACHE_WEB_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["EXPERTCACHE_WEB_SCREENSHOT"])

        # While another client's long requests run, the server keeps answering and the page keeps
        # receiving the cache's state (the token count it shows moves while they run).
        seen: list[int] = []
        done = threading.Event()
        # Long by its generated tokens (a prompt of about 140 tokens, 800 more in a context of 1024):
        # decode steps are what takes the time, each visible in the counters. One such request
        # takes about a second here (four of the page's event periods), so they are repeated
        # until at least two seconds have passed, however fast the machine.
        long_prompt = " ".join(f"x{i} = {i} * {i}" for i in range(20))

        def long_request() -> None:
            try:
                until = time.monotonic() + 2.0
                while True:
                    httpx.post(server.url + "/v1/completions", timeout=TIMEOUT, json={
                        "prompt": long_prompt, "max_tokens": 800, "ignore_eos": True, "cache_prompt": False})
                    if time.monotonic() >= until:
                        break
            finally:
                done.set()

        threading.Thread(target=long_request, daemon=True).start()
        while not done.is_set():
            t0 = time.monotonic()
            assert server.get("/cache/state", None).status_code == 200
            assert time.monotonic() - t0 < 2.0, "the server stopped answering during a request"
            seen.append(int(page_value(browser, "counters", "tokens")))
            time.sleep(0.1)
        assert len(set(seen)) >= 3, f"the page did not follow the request as it ran: {seen}"
        check_counters(browser, server, None)
    finally:
        server.stop()


def test_api_key_slots_and_reconnection(browser):
    server = Server("--api-key", KEY, "-np", "2")
    try:
        assert server.get("/cache/state", None).status_code == 401
        assert server.get("/cache/events?interval=10", "wrong").status_code == 401
        browser.get(server.url)
        dialog = browser.find_element(By.ID, "key-dialog")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, "the page did not ask for the key")
        assert not online(browser)

        set_field(browser, "key-input", "wrong")
        browser.find_element(By.ID, "key-submit").click()
        wait(browser, lambda d: dialog.get_attribute("open") is not None
             and "refused" in d.find_element(By.ID, "key-message").text, "a wrong key was not refused")
        set_field(browser, "key-input", KEY)
        browser.find_element(By.ID, "key-submit").click()
        wait(browser, online, "the page did not connect with the key")
        assert dialog.get_attribute("open") is None
        assert browser.execute_script("return sessionStorage.getItem('expertcache.apiKey')") == KEY
        wait(browser, lambda d: "2 slot(s)" in d.find_element(By.ID, "model").text, "the slots are not shown")

        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "8")
        assert chat(browser, "hello")["predicted-n"] > 0
        check_counters(browser, server, KEY)

        # The server goes away: the page says so, then picks up the new one on the same port.
        port = server.port
        server.stop()
        wait(browser, lambda d: not online(d) and d.find_element(By.ID, "offline").is_displayed(),
             "the page did not show that the server is gone", timeout=20)
        server = Server("--api-key", KEY, "-np", "2", port=port)
        wait(browser, online, "the page did not reconnect", timeout=30)
        assert browser.find_element(By.ID, "offline").is_displayed() is False
        assert dialog.get_attribute("open") is None, "the key was asked for again"
        assert chat(browser, "hello again")["predicted-n"] > 0
        check_counters(browser, server, KEY)
    finally:
        server.stop()
