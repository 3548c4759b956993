// The live view of the expert cache, fed by /cache/events (snapshots as server-sent events, read
// with fetch so that the API key travels as a header). Rendering runs once per animation frame at
// most, on the latest snapshot, so a burst of events never queues work.

import { api, events, sleep } from "./api.js";
import { Plot } from "./plot.js";

const $ = (id) => document.getElementById(id);
const WATCHDOG_MS = 8000;  // the server sends something every 2 s; silence this long means it is gone

// Counters shown "since start", in this order; any other counter the server adds follows them.
const COUNTERS = [
  ["hit_rate", "hit rate"], ["ops_seen", "MoE ops"], ["used_experts_unique", "experts used"],
  ["resident_hits", "hits"], ["resident_misses", "misses"], ["copied_experts", "experts copied"],
  ["copied_bytes", "bytes copied"], ["copy_ranges", "copies issued"], ["evictions", "evictions"],
  ["empty_copy_ops", "ops with no copy"], ["waves", "waves"], ["skipped_experts", "copies avoided"],
  ["skipped_bytes", "bytes not copied"],
];

let latest = null;
let drawn = null;
let frame = 0;
const plot = new Plot($("plot"));

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function setOnline(online, why = "") {
  document.body.dataset.online = online ? "true" : "false";
  $("offline").hidden = online;
  $("offline-why").textContent = why;
  const conn = $("conn");
  conn.dataset.state = online ? "live" : "offline";
  conn.textContent = online ? "live" : "offline";
}

function buildGrid(layers, experts) {
  const grid = $("grid");
  grid.replaceChildren();
  grid.style.setProperty("--experts", experts);
  grid.dataset.layers = layers.length;
  grid.dataset.experts = experts;
  const head = document.createElement("span");
  head.className = "corner";
  head.textContent = "";
  grid.append(head);
  for (let e = 0; e < experts; e++) {
    const h = document.createElement("span");
    h.className = "col";
    h.textContent = e % 8 === 0 ? String(e) : "";
    grid.append(h);
  }
  for (const layer of layers) {
    const label = document.createElement("span");
    label.className = "row";
    label.textContent = `L${layer}`;
    grid.append(label);
    for (let e = 0; e < experts; e++) {
      const cell = document.createElement("i");
      cell.className = "cell";
      cell.dataset.layer = layer;
      cell.dataset.expert = e;
      cell.title = `layer ${layer}, expert ${e}`;
      grid.append(cell);
    }
  }
}

function renderGrid(s) {
  const grid = $("grid");
  const shape = `${s.moe_layers.join(",")}x${s.num_experts}`;
  if (grid.dataset.shape !== shape) {
    buildGrid(s.moe_layers, s.num_experts);
    grid.dataset.shape = shape;
  }
  let resident = 0;
  const cells = grid.getElementsByClassName("cell");
  const E = s.num_experts;
  s.moe_layers.forEach((layer, row) => {
    const now = new Set(s.resident[String(layer)] || []);
    const pre = new Set((s.prefetching || {})[String(layer)] || []);
    resident += now.size;
    for (let e = 0; e < E; e++) {
      const cell = cells[row * E + e];
      const was = cell.classList.contains("r");
      const is = now.has(e);
      cell.classList.toggle("r", is);
      cell.classList.toggle("fresh", is && !was && drawn !== null);
      cell.classList.toggle("p", pre.has(e));
    }
  });
  grid.dataset.resident = resident;
}

function entry(list, key, label, value, text) {
  let dd = list.querySelector(`dd[data-key="${key}"]`);
  if (!dd) {
    const dt = document.createElement("dt");
    dt.textContent = label;
    dd = document.createElement("dd");
    dd.dataset.key = key;
    list.append(dt, dd);
  }
  dd.dataset.value = String(value);
  dd.textContent = text;
}

function renderCounters(s) {
  const total = s.total || {};
  const list = $("counters");
  const known = new Set(COUNTERS.map(([k]) => k));
  const rows = [...COUNTERS, ...Object.keys(total).filter((k) => !known.has(k)).map((k) => [k, k.replaceAll("_", " ")])];
  for (const [key, label] of rows) {
    const v = total[key] ?? 0;
    const text = key === "hit_rate" ? `${(100 * v).toFixed(1)} %` : key.endsWith("bytes") ? bytes(v) : v.toLocaleString("en");
    entry(list, key, label, v, text);
  }
  entry(list, "load_copied_experts", "experts copied at load", s.load_copied_experts ?? 0, (s.load_copied_experts ?? 0).toLocaleString("en"));
  entry(list, "tokens", "tokens through the model", s.tokens ?? 0, (s.tokens ?? 0).toLocaleString("en"));
  const inv = $("invalidations");
  for (const [reason, n] of Object.entries(s.invalidations || {})) entry(inv, reason, reason, n, n.toLocaleString("en"));
  entry(inv, "pre_invalid_loaded", "resident when cleared", s.pre_invalid_loaded ?? 0, String(s.pre_invalid_loaded ?? 0));
  entry(inv, "pre_invalid_hit", "cleared, then needed", s.pre_invalid_hit ?? 0, String(s.pre_invalid_hit ?? 0));
}

function renderInfo(s) {
  $("mode").textContent = s.mode ?? "–";
  $("policy").textContent = s.policy ?? "–";
  $("store").textContent = s.store ?? "–";
  const pct = s.total_experts ? (100 * s.capacity / s.total_experts).toFixed(0) : "–";
  $("pool").textContent = `${s.capacity} of ${s.total_experts} experts (${pct} %), ${bytes(s.pool_bytes || 0)}`;
  $("pool").dataset.capacity = s.capacity;
  const sv = s.server || {};
  $("slots").textContent = `${sv.slots} · ${sv.processing ? "running" : "idle"}${sv.deferred ? `, ${sv.deferred} queued` : ""}`;
  for (const k of ["mode", "policy", "store"]) $(k).dataset.value = s[k] ?? "";
}

function render() {
  frame = 0;
  const s = latest;
  if (!s || s === drawn) return;
  renderInfo(s);
  renderGrid(s);
  renderCounters(s);
  plot.add(s);
  drawn = s;
}

function receive(s) {
  latest = s;
  if (!frame) frame = requestAnimationFrame(render);
}

// `onConnect` runs each time the stream (re)connects: the server may have been restarted with
// another model or other flags, so what the page shows about it is read again.
export async function startCache(onConnect = () => {}) {
  let backoff = 500;
  for (;;) {
    const ctrl = new AbortController();
    let timer = 0;
    const watch = () => { clearTimeout(timer); timer = setTimeout(() => ctrl.abort(), WATCHDOG_MS); };
    try {
      const r = await api("cache/events", { signal: ctrl.signal });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      watch();
      setOnline(true);
      onConnect();
      backoff = 500;
      for await (const data of events(r, watch)) receive(JSON.parse(data));
      throw new Error("the event stream ended");
    } catch (e) {
      setOnline(false, e.name === "AbortError" ? "no answer for a while" : e.message);
    } finally {
      clearTimeout(timer);
    }
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 4000);
  }
}
