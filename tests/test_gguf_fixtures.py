"""The committed GGUF fixtures (tests/fixtures/gguf/, made by tools/make_gguf_fixtures.py) and
llama.cpp's recordings beside them: the files open with gguf-py, their tensors cover every storage
type the engine must read, and each recording is complete and agrees with its GGUF and with the
held-out text. Needs only gguf and numpy."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
REQUIRED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                  "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
FAMILIES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",
            "qwen3_5_moe": "qwen35moe", "gemma4": "gemma4", "gemma4_v": "gemma4"}
# llama.cpp's CPU GELU goes through an fp16 table: its Gemma 4 logits differ from transformers'
# by about 1e-3 relative, where SwiGLU families agree to 1e-5.
F32_AGREEMENT = {"gemma4": 5e-3, "gemma4_v": 5e-3}
# Model fixtures; tokenizers/ holds vocabulary-only files with their own tests.
GGUF_FILES = sorted(p for p in FIXTURES.rglob("*.gguf") if "tokenizers" not in p.relative_to(FIXTURES).parts)


def _reader(path: Path):
    return gguf.GGUFReader(path)


def _field(reader, key: str):
    return reader.fields[key].contents()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a token string uses for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def test_fixtures_exist():
    assert GGUF_FILES, f"no GGUF fixtures in {FIXTURES}"
    families = set()
    for path in GGUF_FILES:
        for suffix in (".json", ".npz"):
            other = path.with_suffix(suffix)
            assert other.is_file(), f"{path.name} has no recording {other.name}"
        families.add(json.loads(path.with_suffix(".json").read_text())["family"])
    assert families == set(FAMILIES), f"fixture families {sorted(families)}, expected {sorted(FAMILIES)}"
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.suffix in (".gguf", ".json", ".npz"))
    assert total < 12_000_000, f"fixtures take {total} bytes; keep them to a few MB"


def test_tensor_types_cover_every_storage_type():
    seen = {t.tensor_type.name for path in GGUF_FILES for t in _reader(path).tensors}
    missing = [t for t in REQUIRED_TYPES if t not in seen]
    assert not missing, f"no fixture holds a tensor of type {', '.join(missing)}"


@pytest.mark.parametrize("path", GGUF_FILES, ids=[p.stem for p in GGUF_FILES])
def test_recording_matches_its_gguf(path: Path):
    rec = json.loads(path.with_suffix(".json").read_text())
    assert rec["gguf"] == path.name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["sha256"], "the GGUF changed after recording"
    reader = _reader(path)
    assert _field(reader, "general.architecture") == FAMILIES[rec["family"]]
    assert {t.name: t.tensor_type.name for t in reader.tensors} == rec["tensor_types"]
    # Every tensor dequantizes (gguf-py's reference code) to finite values of its stated shape.
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert w.shape[-1] == int(t.shape[0]) and w.size == int(np.prod(t.shape)), t.name
        assert np.isfinite(w).all(), f"{path.name}: {t.name} dequantizes to non-finite values"
    cfg = rec["hf_config"]
    arch = FAMILIES[rec["family"]]
    assert _field(reader, f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert _field(reader, f"{arch}.embedding_length") == cfg["hidden_size"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]
    # Before quantization, llama.cpp's forward on the F32 file matched transformers' fp32 one.
    agree = rec["f32_vs_transformers"]
    bound = F32_AGREEMENT.get(rec["family"], 1e-4)
    assert agree["argmax_equal"] and agree["max_abs_diff"] < bound * agree["max_abs_logit"], agree


@pytest.mark.parametrize("path", GGUF_FILES, ids=[p.stem for p in GGUF_FILES])
def test_token_ids_spell_the_text(path: Path):
    """llama.cpp's recorded ids, looked up in the GGUF's own vocabulary and byte-decoded, give
    back the held-out slice and the prompt exactly."""
    rec = json.loads(path.with_suffix(".json").read_text())
    reader = _reader(path)
    vocab = _field(reader, "tokenizer.ggml.tokens")
    dec = _byte_decoder()
    sentencepiece = _field(reader, "tokenizer.ggml.model") == "gemma4"  # '▁' for spaces, <0xXX> bytes
    control = {i for i, t in enumerate(_field(reader, "tokenizer.ggml.token_type")) if t == 3}

    def piece(i: int) -> bytes:
        t = vocab[i]
        if not sentencepiece:
            return bytes(dec[c] for c in t)
        if i in control:  # BOS
            return b""
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return bytes([int(t[3:5], 16)])
        return t.replace("\u2581", " ").encode("utf-8")

    def spell(ids: list[int]) -> str:
        assert all(0 <= i < len(vocab) for i in ids)
        return b"".join(piece(i) for i in ids).decode("utf-8")

    start, end = rec["heldout"]["chars"]
    text = (ROOT / rec["heldout"]["file"]).read_text(encoding="utf-8")[start:end]
    assert hashlib.sha256(text.encode()).hexdigest() == rec["heldout"]["sha256"], "heldout.txt changed"
    assert spell(rec["heldout"]["tokens"]) == text
    assert spell(rec["prompt"]["tokens"]) == rec["prompt"]["text"]
    if not sentencepiece:  # the byte-level ones: tokenizer.json's own BPE gives llama.cpp's ids
        assert rec["heldout"]["hf_tokenizer_equal"], "llama.cpp tokenized the slice unlike tokenizer.json"


@pytest.mark.parametrize("path", GGUF_FILES, ids=[p.stem for p in GGUF_FILES])
def test_logits_and_perplexity_recordings(path: Path):
    rec = json.loads(path.with_suffix(".json").read_text())
    n_vocab = rec["hf_config"]["vocab_size"]
    logits = np.load(path.with_suffix(".npz"))[rec["prompt"]["logits"]]
    assert logits.dtype == np.float32
    assert logits.shape == (len(rec["prompt"]["tokens"]), n_vocab) == tuple(rec["prompt"]["logits_shape"])
    assert np.isfinite(logits).all()
    # Informative: every position has a clear favourite, and positions differ.
    assert (logits.std(axis=1) > 0.5).all()
    assert len({int(a) for a in logits.argmax(axis=1)}) > 1

    ppl = rec["perplexity"]
    n_ctx = ppl["n_ctx"]
    assert n_ctx == rec["llama_cpp"]["n_ctx"]
    assert ppl["n_tokens"] == len(rec["heldout"]["tokens"])
    assert ppl["chunks"] == ppl["n_tokens"] // n_ctx == len(ppl["chunk_nll"]) >= 2
    assert ppl["scored_per_chunk"] == n_ctx - 1 - n_ctx // 2
    if rec["family"].startswith("gemma4"):  # llama.cpp always adds BOS for Gemma 4
        assert ppl["add_bos"] is True and ppl["bos_id"] == 2
    else:
        assert ppl["add_bos"] is False and ppl["bos_id"] is None  # the tokenizer adds no BOS
    assert all(math.isfinite(v) and v > 0 for v in ppl["chunk_nll"])
    mean = sum(ppl["chunk_nll"]) / (ppl["chunks"] * ppl["scored_per_chunk"])
    assert ppl["ppl"] == pytest.approx(math.exp(mean), rel=1e-12)
    assert ppl["ppl"] > 1.0
