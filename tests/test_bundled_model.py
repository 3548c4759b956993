"""The bundled model: transformers loads it and agrees with us, and `expertcache run` works with
no --model."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import expertcache
from expertcache.engine import default_model_path


def test_bundled_model_is_a_real_checkpoint():
    d = default_model_path()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["num_experts_per_tok"] >= 4 and cfg["num_hidden_layers"] >= 4
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg.get("num_experts", cfg.get("num_local_experts")) >= 32
    assert sum(p.stat().st_size for p in d.iterdir()) <= 32 * 2**20
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] and tok_cfg["chat_template"]
    assert (d.parent / "heldout.txt").stat().st_size > 100_000


def test_transformers_agrees_with_us_on_the_bundled_model():
    import transformers

    d = default_model_path()
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = expertcache.load(dtype="float32")
    text = (d.parent / "heldout.txt").read_text()[:2000]
    ids = model.tokenizer.encode(text)[:96]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.logits(ids), expected, atol=2e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(d).encode(text[:500]) == model.tokenizer.encode(text[:500])


def test_run_without_model_prints_a_continuation():
    p = subprocess.run([sys.executable, "-m", "expertcache.cli", "run", "-p", "def fibonacci(n):", "-n", "24",
                        "-t", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("def fibonacci(n):") and len(p.stdout.strip()) > len("def fibonacci(n):")
