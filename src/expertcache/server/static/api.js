// Calls to the server: every request carries the API key when there is one; a 401 asks the user
// for the key (once, however many requests are waiting) and retries.

const KEY = "expertcache.apiKey";
let asking = null;

export function apiKey() {
  return sessionStorage.getItem(KEY);
}

function askKey(message) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message;
  input.value = "";
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = input.value.trim();
      if (key) sessionStorage.setItem(KEY, key);
      asking = null;
      resolve();
    }, { once: true });
  });
  dialog.showModal();
  input.focus();
  return asking;
}

// fetch() with the key; on 401, ask for a key and try again (until the server takes one).
export async function api(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    if (apiKey() !== key) continue;  // a key was entered while this request was on its way
    let reason = "";
    try { reason = (await response.json()).error.message; } catch { /* not our error shape */ }
    if (key && apiKey() === key) sessionStorage.removeItem(KEY);
    await askKey(key ? `The key was refused (${reason}). Enter the server's API key.`
                     : "This server wants an API key.");
  }
}

// The `data:` payloads of a server-sent event stream read with fetch (EventSource cannot send a
// header). `onActivity` hears every chunk, comments included, for a watchdog.
export async function* events(response, onActivity = () => {}) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    onActivity();
    buffer += decoder.decode(value, { stream: true });
    let m;
    while ((m = /\r?\n\r?\n/.exec(buffer)) !== null) {
      const block = buffer.slice(0, m.index);
      buffer = buffer.slice(m.index + m[0].length);
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
