"""Checks shared by the GGUF family tests whose fixtures carry llama.cpp's recordings
(tools/make_gguf_fixtures.py writes NAME.gguf beside NAME.json, with the prompt, the held-out
tokens and llama.cpp's perplexity, and NAME.npz, with its logits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.kernels.quant_native import load_quant_native

ROOT = Path(__file__).resolve().parents[1]

# Cache configurations a family's results must not depend on (each against the resident mode).
CACHES = [CacheConfig(mode="staging"), CacheConfig(mode="cache", experts=1),
          CacheConfig(mode="cache", experts=3, store="disk", policy="lfu"),
          CacheConfig(mode="cache", fraction=0.5, store="mmap"), CacheConfig(mode="staging", experts=2, store="disk")]


def record(fixtures: Path, name: str) -> dict:
    return json.loads((fixtures / f"{name}.json").read_text())


def llama_logits(fixtures: Path, name: str) -> torch.Tensor:
    return torch.from_numpy(np.load(fixtures / f"{name}.npz")["logits"])


def check_token_ids(fixtures: Path, name: str) -> None:
    """Our tokenizer from the file's metadata gives llama.cpp's ids on the prompt and the text."""
    rec = record(fixtures, name)
    model = expertcache.load(fixtures / f"{name}.gguf")
    assert model.tokenizer.encode(rec["prompt"]["text"]) == rec["prompt"]["tokens"]
    start, end = rec["heldout"]["chars"]
    text = (ROOT / rec["heldout"]["file"]).read_text(encoding="utf-8")[start:end]
    assert model.tokenizer.encode(text) == rec["heldout"]["tokens"]


def check_cache_independence(fixtures: Path, name: str, dtype: str, tokens: int, prefill: int, ubatch: int) -> None:
    """Prefill of `prefill` recorded tokens in micro-batches of `ubatch`, then one step per token
    up to `tokens`, and a short generation: bitwise the same in every mode of `CACHES`, each of
    which really copies experts."""
    path = fixtures / f"{name}.gguf"
    ids = record(fixtures, name)["heldout"]["tokens"][:tokens]

    def run(cache):
        model = expertcache.load(path, dtype=dtype, cache=cache)
        s = model.new_session()
        out = [model.prefill(s, ids[:prefill], ubatch=ubatch, all_logits=True)]
        out += [model.prefill(s, [t], all_logits=True) for t in ids[prefill:]]
        gen = model.generate(ids[:20], max_tokens=8, ignore_eos=True).token_ids
        return torch.cat(out), gen, model.telemetry()

    want, want_gen, _ = run(CacheConfig(mode="resident"))
    for cache in CACHES:
        got, gen, tel = run(cache)
        assert torch.equal(got, want), cache
        assert gen == want_gen, cache
        assert tel["total"]["copied_experts"] > 0, cache


# Slot fillings: once (resident, the RAM store), where tiles are formed; and on every miss (disk).
SLOT_FILLS = {"resident": CacheConfig(mode="resident"), "ram": CacheConfig(store="ram", experts=8),
              "disk": CacheConfig(store="disk", experts=8)}


def check_slots_hold_the_files_bytes(path: Path, layer: int, fill: str) -> list:
    """A resident expert's slot holds each matrix as the file's bytes, or, where the kernels read
    its type as tiles of eight rows and the slot is filled once (`SLOT_FILLS`), those bytes
    interleaved by the kernels' own `tile_rows`; a store read on every miss keeps the file's
    bytes. Returns the matrix formats of MoE layer `layer`."""
    import gguf

    cache = SLOT_FILLS[fill]
    model = expertcache.load(path, cache=cache)
    model.logits(list(range(1, 17)))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    k = model.net.kernels
    for fmt in model.experts.formats.values():
        for m in fmt.matrices:
            assert m.tiled == (fill != "disk" and k.holds_tiles(m.storage, m.shape)), m
    key = model.experts.residency.resident_keys()[-1]  # the last layer's, in a cache of fewer slots
    fmt = model.experts.formats[key.layer]
    row = model.experts.pool[model.experts.residency.slot_of(key)]
    for m in fmt.matrices:
        name = f"blk.{key.layer}.ffn_{m.name}_exps.weight"
        want = torch.from_numpy(np.asarray(tensors[name].data[key.expert]).copy())
        want = want.reshape(-1).view(torch.uint8).view(m.shape[0], -1)
        if m.tiled:
            want = load_quant_native().tile_rows(want, int(m.storage), m.shape[1])
        assert bytes(row[m.offset: m.offset + m.nbytes].numpy()) == bytes(want.reshape(-1).numpy()), m
    return list(model.experts.formats[layer].matrices)
