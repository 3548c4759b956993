// A running plot of the cache per token: between two snapshots, the hit rate of the experts used
// (left axis, 0-100 %) and the bytes copied per token processed (right axis), against the tokens
// the model has processed since the server started.

const POINTS = 300;
const HIT = "#2a9d5c";
const BYTES = "#e07a1f";

function scaleBytes(max) {
  const units = [["B", 1], ["KiB", 1024], ["MiB", 1024 ** 2], ["GiB", 1024 ** 3]];
  let u = units[0];
  for (const x of units) if (max >= x[1]) u = x;
  return u;
}

export class Plot {
  constructor(canvas) {
    this.canvas = canvas;
    this.points = [];  // {x: tokens, hit: 0..1 | null, bpt: bytes per token | null}
    this.prev = null;
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  add(s) {
    const t = s.total || {};
    const now = { tokens: s.tokens || 0, used: t.used_experts_unique || 0, hits: t.resident_hits || 0,
                  copied: t.copied_bytes || 0 };
    const p = this.prev;
    this.prev = now;
    if (p === null) return;
    if (now.tokens < p.tokens || now.used < p.used) {  // another server (a restart): start over
      this.points = [];
      return;
    }
    const dTokens = now.tokens - p.tokens;
    const dUsed = now.used - p.used;
    if (dTokens <= 0 && dUsed <= 0) return;
    this.points.push({
      x0: p.tokens,
      x: now.tokens,
      hit: dUsed > 0 ? (now.hits - p.hits) / dUsed : null,
      bpt: dTokens > 0 ? (now.copied - p.copied) / dTokens : null,
    });
    if (this.points.length > POINTS) this.points.shift();
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (!w || !h) return;
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const pad = { l: 42, r: 62, t: 10, b: 22 };
    const pw = w - pad.l - pad.r;
    const ph = h - pad.t - pad.b;
    const pts = this.points;
    c.dataset.points = pts.length;
    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#d0d4da";
    g.fillStyle = "#667";
    g.lineWidth = 1;
    g.strokeRect(pad.l, pad.t, pw, ph);
    if (!pts.length) {
      g.fillText("no tokens yet: send a message", pad.l + 8, pad.t + ph / 2);
      return;
    }
    const x0 = Math.min(pts[0].x0, pts[0].x - 1);
    const x1 = pts[pts.length - 1].x;
    const X = (x) => pad.l + (pw * (x - x0)) / Math.max(1, x1 - x0);
    const maxB = Math.max(1, ...pts.map((p) => p.bpt ?? 0));
    const [unit, div] = scaleBytes(maxB);
    const yHit = (v) => pad.t + ph * (1 - v);
    const yB = (v) => pad.t + ph * (1 - v / maxB);
    for (let i = 0; i <= 4; i++) {  // grid and both axes' labels
      const y = pad.t + (ph * i) / 4;
      g.strokeStyle = "#eceef1";
      g.beginPath(); g.moveTo(pad.l, y); g.lineTo(pad.l + pw, y); g.stroke();
      g.fillStyle = HIT;
      g.textAlign = "right";
      g.fillText(`${100 - 25 * i}%`, pad.l - 4, y + 4);
      g.fillStyle = BYTES;
      g.textAlign = "left";
      g.fillText(`${((maxB * (4 - i)) / 4 / div).toFixed(1)} ${unit}`, pad.l + pw + 4, y + 4);
    }
    g.fillStyle = "#667";
    g.textAlign = "center";
    g.fillText(`tokens processed: ${x0.toLocaleString("en")} … ${x1.toLocaleString("en")}`, pad.l + pw / 2, h - 6);
    // Each value is an average over the tokens between two snapshots: a step over that range.
    const line = (key, y, color) => {
      g.strokeStyle = color;
      g.lineWidth = 1.5;
      g.beginPath();
      let end = null;
      for (const p of pts) {
        if (p[key] === null) { end = null; continue; }
        const a = Math.max(X(p.x0), pad.l);
        if (end === null || Math.abs(end - a) > 1) g.moveTo(a, y(p[key])); else g.lineTo(a, y(p[key]));
        g.lineTo(Math.max(X(p.x), a + 1), y(p[key]));
        end = Math.max(X(p.x), a + 1);
      }
      g.stroke();
    };
    line("bpt", yB, BYTES);
    line("hit", yHit, HIT);
    const last = pts[pts.length - 1];
    c.dataset.hit = last.hit ?? "";
    c.dataset.bytesPerToken = last.bpt ?? "";
  }
}
