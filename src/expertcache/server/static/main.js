// The page: the chat on the left, the cache on the right.

import { api, sleep } from "./api.js";
import { startCache } from "./cache.js";
import { startChat } from "./chat.js";

async function showModel() {
  for (;;) {
    try {
      const r = await api("v1/models");
      if (r.ok) {
        const m = (await r.json()).data[0];
        const el = document.getElementById("model");
        el.textContent = `${m.id} · context ${m.meta.n_ctx} tokens · ${m.meta.n_slots} slot(s)`;
        el.dataset.model = m.id;
        return;
      }
    } catch { /* the server is away: the cache view says so; try again */ }
    await sleep(2000);
  }
}

startChat();
startCache(showModel);  // on every (re)connect: a restarted server may serve another model, context or slots
