"""Perplexity of each GGUF fixture against llama.cpp's recording, for each way of taking a
quantized product's input (`--activations`), and the prompt logits' largest difference.

    python tools/fixture_perplexity.py [--fixtures NAME,...]

Prints a table and one JSON line. Needs only the fixtures and their recordings (tests/fixtures/gguf).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import expertcache
from expertcache.perplexity import perplexity, perplexity_bos_id

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf"
NAMES = ["qwen2_moe-Q4_K_M", "qwen3_moe-mix", "olmoe-Q8_0", "mixtral-Q8_0", "qwen3_5_moe/qwen3_5_moe-Q8_0",
         "gemma4/gemma4-Q8_0"]
SETTINGS = [("exact", "float32"), ("q8", "float32"), ("auto", "bfloat16")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", default=",".join(NAMES), help="comma-separated fixture names")
    args = p.parse_args(argv)
    for name in args.fixtures.split(","):
        if not (FIXTURES / f"{name}.gguf").is_file() or not (FIXTURES / f"{name}.json").is_file():
            p.error(f"--fixtures: no fixture {name!r} with its recording in {FIXTURES}: expected names such as "
                    f"{', '.join(NAMES)}")
    out = {}
    print(f"{'fixture':<30} " + " ".join(f"{a + '/' + d:>24}" for a, d in SETTINGS))
    for name in args.fixtures.split(","):
        path = FIXTURES / f"{name}.gguf"
        rec = json.loads(path.with_suffix(".json").read_text())
        want = torch.from_numpy(np.load(path.with_suffix(".npz"))[rec["prompt"]["logits"]])
        cells, out[name] = [], {}
        for acts, dtype in SETTINGS:
            model = expertcache.load(path, dtype=dtype, activations=acts)
            got = model.logits(rec["prompt"]["tokens"]).float()
            rel = float((got - want).abs().max() / want.abs().max())
            bos = perplexity_bos_id(model.tokenizer) if rec["perplexity"].get("add_bos") else None
            ppl = perplexity(model, rec["heldout"]["tokens"], n_ctx=rec["perplexity"]["n_ctx"], bos_id=bos).ppl
            diff = ppl / rec["perplexity"]["ppl"] - 1
            out[name][f"{acts}/{dtype}"] = {"ppl_rel_diff": diff, "logits_rel_diff": rel}
            cells.append(f"ppl {diff:+.3%} lg {rel:.1e}")
        print(f"{name:<30} " + " ".join(f"{c:>24}" for c in cells), flush=True)
    print(json.dumps({"tool": "fixture_perplexity", "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
