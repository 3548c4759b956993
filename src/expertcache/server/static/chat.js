// The chat view: one conversation over the server's /v1/chat/completions, streamed. The whole
// conversation is sent each turn; the server reuses the prefix it still holds (cache_n).

import { api, events } from "./api.js";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "stop_strings"];
const STORE = "expertcache.settings";

let history = [];     // {role, content} of finished turns
let running = null;   // the AbortController of the reply in progress
let conversation = 0; // counts "New chat": a reply that ends after one belongs to a conversation gone

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch { /* start afresh */ }
  for (const id of SETTINGS) if (id in saved) $(id).value = saved[id];
  const save = () => {
    localStorage.setItem(STORE, JSON.stringify(Object.fromEntries(SETTINGS.map((k) => [k, $(k).value]))));
  };
  // Saved as typed ("input"), not only when the field loses focus ("change"): a reload or a closed
  // tab fires no "change", and the value being typed would be lost.
  for (const id of SETTINGS) for (const ev of ["input", "change"]) $(id).addEventListener(ev, save);
}

function number(id, fallback) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : fallback;
}

function request(messages) {
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature", 0.8), top_p: number("top_p", 0.95),
    max_tokens: Math.max(1, Math.round(number("max_tokens", 256))),
  };
  const stop = $("stop_strings").value.split("\n").filter((s) => s !== "").map((s) => s.replaceAll("\\n", "\n"));
  if (stop.length) body.stop = stop;
  return body;
}

// Whether the conversation is scrolled to its end (within a few pixels): only then does new text
// keep it there, so a reader who scrolled up to an earlier part is not pulled back.
function atEnd() {
  const m = $("messages");
  return m.scrollHeight - m.scrollTop - m.clientHeight < 8;
}

function toEnd() {
  const m = $("messages");
  m.scrollTop = m.scrollHeight;
}

function bubble(role, text = "") {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const t = document.createElement("div");
  t.className = "text";
  t.textContent = text;
  div.append(t);
  $("messages").append(div);
  toEnd();
  return div;
}

const fmt = (x, digits = 1) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

function showTimings(div, t) {
  const s = document.createElement("div");
  s.className = "stats";
  s.dataset.promptN = t.prompt_n;
  s.dataset.cacheN = t.cache_n;
  s.dataset.predictedN = t.predicted_n;
  s.textContent = `prompt ${t.prompt_n} tok at ${fmt(t.prompt_per_second)} tok/s, ${t.cache_n} reused from the prompt cache`
    + ` · generation ${t.predicted_n} tok at ${fmt(t.predicted_per_second)} tok/s`;
  div.append(s);
}

function fail(div, message) {
  const e = document.createElement("div");
  e.className = "error";
  e.textContent = message;
  div.append(e);
  div.dataset.error = "true";
}

async function send(text) {
  const mine = conversation;
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: text });
  bubble("user", text);
  const div = bubble("assistant");
  div.dataset.done = "false";
  const out = div.querySelector(".text");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  let finished = false;
  // The text is drawn once per animation frame, not once per piece: each draw lays out the whole
  // reply, so drawing every piece of a long answer costs quadratic time and freezes the page.
  let frame = 0;
  const draw = () => {
    frame = 0;
    if (out.textContent === answer) return;
    const follow = atEnd();
    out.textContent = answer;
    if (follow) toEnd();
  };
  try {
    const r = await api("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request(messages)), signal: running.signal,
    });
    if (!r.ok) {
      let message = `HTTP ${r.status}`;
      try { message = (await r.json()).error.message; } catch { /* not JSON */ }
      throw new Error(message);
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") { finished = true; break; }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = (chunk.choices || [])[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        answer += piece;
        if (!frame) frame = requestAnimationFrame(draw);
      }
      if (chunk.timings) {
        const follow = atEnd();
        draw();
        showTimings(div, chunk.timings);
        if (follow) toEnd();
      }
      if (choice && choice.finish_reason) div.dataset.finish = choice.finish_reason;
    }
    if (!finished) throw new Error("the stream ended early");
  } catch (e) {
    fail(div, e.name === "AbortError" ? "stopped" : `error: ${e.message}`);
  } finally {
    cancelAnimationFrame(frame);
    draw();
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    div.dataset.done = "true";
  }
  // After "New chat" the reply (aborted by it) and its message belong to no conversation: they
  // neither join the new one's history nor come back into the message box.
  if (mine !== conversation) return;
  // A stopped reply stays in the conversation as far as it got, as in llama-server's page.
  if (answer || finished) history.push({ role: "user", content: text }, { role: "assistant", content: answer });
  else { $("prompt").value = $("prompt").value || text; div.previousElementSibling.remove(); }
}

export function startChat() {
  loadSettings();
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || running) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", () => {
    conversation++;
    if (running) running.abort();
    history = [];
    $("messages").replaceChildren();
  });
}
