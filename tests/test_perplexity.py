"""`expertcache perplexity`: the number against a reference computed here from the definition with
the transformers model, bitwise equality across cache modes, cache hits, and bad input."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

import expertcache
import expertcache.engine
from conftest import VOCAB
from expertcache.cli import main

ASSETS = Path(expertcache.__file__).parent / "assets"
BUNDLED_MODEL, HELDOUT = ASSETS / "tiny-qwen3-moe", ASSETS / "heldout.txt"


def write_text(path: Path, n_words: int, seed: int = 0) -> list[int]:
    """A text of random words of the test tokenizer; returns their ids (w{i} has id i + 4)."""
    rng = random.Random(seed)
    words = [rng.randrange(VOCAB - 4) for _ in range(n_words)]
    path.write_text(" ".join(f"w{w}" for w in words))
    return [w + 4 for w in words]


def run_json(capsys, *argv) -> tuple[int, dict, str]:
    code = main(["perplexity", *map(str, argv), "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def reference(ref, ids: list[int], n_ctx: int, bos: int | None = None) -> tuple[list[float], float, float]:
    """llama-perplexity's definition, with the transformers model: consecutive chunks of n_ctx, each
    a fresh forward with its first token replaced by BOS; score the tokens predicted from positions
    n_ctx/2 .. n_ctx-2. Returns the cumulative PPLs, the final PPL and its uncertainty."""
    first = n_ctx // 2
    per_chunk, cumulative = [], []
    for i in range(len(ids) // n_ctx):
        chunk = ids[i * n_ctx: (i + 1) * n_ctx]
        inp = ([bos] if bos is not None else chunk[:1]) + chunk[1:]
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([inp])).logits[0].double(), dim=-1)  # [n_ctx, V]
        targets = torch.tensor(chunk[first + 1:])
        per_chunk.append(-logp[first: n_ctx - 1].gather(1, targets[:, None])[:, 0])
        cumulative.append(math.exp(torch.cat(per_chunk).mean().item()))
    nll = torch.cat(per_chunk)
    ppl = math.exp(nll.mean().item())
    return cumulative, ppl, ppl * math.sqrt(nll.var(unbiased=False).item() / (len(nll) - 1))


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_matches_reference_computation(tiny_checkpoint, tmp_path, capsys, bos):
    ref, d = tiny_checkpoint("qwen3_moe")
    ids = write_text(tmp_path / "text.txt", 4 * 32 + 13)
    if bos:  # a tokenizer that adds BOS: every chunk starts with it
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(bos_token="<|im_start|>", add_bos_token=True)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        ids = [2, *ids]
    code, out, _ = run_json(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 32, "--ubatch", 12)
    cumulative, ppl, unc = reference(ref, ids, 32, bos=2 if bos else None)
    assert code == 0
    assert out["chunks"] == 4 and out["scored_tokens"] == 4 * 15 and out["n_tokens"] == len(ids)
    assert out["bos_id"] == (2 if bos else None)
    assert out["ppl_cumulative"] == pytest.approx(cumulative, rel=1e-4)
    assert out["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert out["ppl_uncertainty"] == pytest.approx(unc, rel=1e-4)
    assert out["ppl_cumulative"][-1] == out["ppl"]
    assert len(out["chunk_ppl"]) == 4 and out["telemetry"]["mode"] == "resident"


def test_text_output_in_llama_perplexity_format(tiny_checkpoint, tmp_path, capsys):
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    write_text(tmp_path / "text.txt", 3 * 16)
    assert main(["perplexity", "-m", str(d), "-f", str(tmp_path / "text.txt"), "-c", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\[1\]\d+\.\d{4},\[2\]\d+\.\d{4},\[3\]\d+\.\d{4},", lines[0])
    assert re.fullmatch(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", lines[1])
    assert lines[1].split()[4] == lines[0].split(",")[-2].split("]")[1]


def check_compare(capsys, *argv) -> dict:
    code, out, _ = run_json(capsys, *argv, "--compare", "resident,staging,cache", "--cache-fraction", 0.1)
    assert out["bitwise_equal"] and out["first_difference"] is None and code == 0
    nll = [m["chunk_nll"] for m in out["modes"].values()]
    assert nll[0] == nll[1] == nll[2]
    cache = out["modes"]["cache"]["telemetry"]
    assert cache["capacity"] < cache["total_experts"] and cache["total"]["resident_misses"] > 0
    return out


def test_compare_modes_bitwise_equal_on_bundled_model(capsys):
    assert (BUNDLED_MODEL / "model.safetensors").is_file() and HELDOUT.is_file(), (
        f"the bundled model {BUNDLED_MODEL} and its held-out text {HELDOUT} must exist")
    out = check_compare(capsys, "-f", HELDOUT, "-c", 256, "--chunks", 3)
    assert out["chunks"] == 3


def test_compare_modes_bitwise_equal_on_fixture(tiny_checkpoint, tmp_path, capsys):
    _, d = tiny_checkpoint("qwen3_moe", experts=16, layers=2)
    write_text(tmp_path / "text.txt", 3 * 32)
    check_compare(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 32)


def test_compare_names_first_differing_chunk(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    write_text(tmp_path / "text.txt", 3 * 16)
    real_load = expertcache.engine.load

    def load(*args, cache=None, **kwargs):
        model = real_load(*args, cache=cache, **kwargs)
        if cache.mode == "cache":  # a broken cache: from the second chunk on, routing weights drift
            ops = []

            def override(layer, routing):
                ops.append(layer)
                if len(ops) > 2:  # 2 MoE ops per chunk
                    routing.weights = routing.weights * 1.01
                return routing

            model.net.routing_override = override
        return model

    monkeypatch.setattr(expertcache.engine, "load", load)
    code, out, _ = run_json(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 16, "--compare", "resident,cache")
    assert code == 1 and not out["bitwise_equal"] and out["first_difference"]["chunk"] == 2
    args = ["perplexity", "-m", str(d), "-f", str(tmp_path / "text.txt"), "-c", "16", "--compare", "resident,cache"]
    assert main(args) == 1
    assert "DIFFERENT: chunk 2 differs" in capsys.readouterr().out


def test_cache_hits_and_copies_less_than_staging(tiny_checkpoint, tmp_path, capsys):
    _, d = tiny_checkpoint("qwen3_moe", experts=16, layers=2)
    write_text(tmp_path / "text.txt", 4 * 32)
    code, out, _ = run_json(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 32, "--ubatch", 4,
                         "--compare", "staging,cache", "--cache-fraction", 0.5)
    assert code == 0 and out["chunks"] == 4
    cache, staging = out["modes"]["cache"]["telemetry"], out["modes"]["staging"]["telemetry"]
    assert cache["capacity"] == cache["total_experts"] // 2
    assert cache["total"]["resident_hits"] > 0
    assert cache["total"]["copied_bytes"] < staging["total"]["copied_bytes"]
    assert staging["total"]["resident_hits"] == 0


@pytest.mark.parametrize("case", ["short", "empty", "missing", "directory", "bad-compare"])
def test_bad_input_is_one_line_exit_2(tiny_checkpoint, tmp_path, capsys, case):
    _, d = tiny_checkpoint("qwen3_moe", layers=1)
    f = tmp_path / "text.txt"
    argv = ["perplexity", "-m", str(d), "-f", str(f), "-c", "32"]
    expect = {"short": "the text has 50 tokens; a context of 32 needs at least 64", "empty": "is empty",
              "missing": "cannot read", "directory": "cannot read", "bad-compare": "unknown cache mode 'bogus'"}[case]
    if case in ("short", "bad-compare"):
        write_text(f, 50)
    elif case == "empty":
        f.write_text("")
    elif case == "directory":
        f.mkdir()
    if case == "bad-compare":
        argv += ["--compare", "resident,bogus"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err


def test_context_above_training_context_warns(tiny_checkpoint, tmp_path, capsys):
    _, d = tiny_checkpoint("qwen3_moe", layers=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    write_text(tmp_path / "text.txt", 2 * 32)
    code, out, err = run_json(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 32)
    assert code == 0 and out["chunks"] == 2
    assert "trained on only 16 context tokens (32 specified)" in err


def test_a_perplexity_past_a_double_is_inf_not_a_crash(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # A model far off on the text (a broken checkpoint): a mean NLL above ~709.8 nats overflows
    # math.exp. llama-perplexity's std::exp prints inf; the running values and the estimate say inf.
    import expertcache.perplexity as ppl_module

    _, d = tiny_checkpoint("qwen3_moe", layers=1)
    write_text(tmp_path / "text.txt", 2 * 16)
    real = ppl_module.token_nll
    monkeypatch.setattr(ppl_module, "token_nll", lambda logits, targets: real(logits, targets) * 1e3 + 1e3)
    assert main(["perplexity", "-m", str(d), "-f", str(tmp_path / "text.txt"), "-c", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[1]inf,[2]inf," and lines[1].startswith("Final estimate: PPL = inf")
    code, out, _ = run_json(capsys, "-m", d, "-f", tmp_path / "text.txt", "-c", 16)
    # JSON has no infinity: null, as tests/test_cli_leftovers.py checks with a strict parser.
    assert code == 0 and out["ppl"] is None and out["chunk_ppl"] == [None, None]


def test_text_that_spells_a_special_token_is_text(tmp_path, capsys):
    # llama-perplexity tokenizes with parse_special off: "<|endoftext|>" in the text is its
    # characters, not the end-of-text token (which would also change the scored tokens).
    from expertcache.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_MODEL)
    text = "def f(x):\n    return x  # <|endoftext|> and <|im_end|> are text here\n" * 6
    special = {tok.tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
    parsed, plain = tok.encode(text), tok.encode(text, parse_special=False)
    assert special & set(parsed) and not special & set(plain)
    assert tok.decode(plain, skip_special_tokens=False) == text
    assert tok.encode(text) == parsed  # the shared tokenizer is unchanged
    (tmp_path / "t.txt").write_text(text)
    code, out, _ = run_json(capsys, "-m", BUNDLED_MODEL, "-f", tmp_path / "t.txt", "-c", 32)
    # The file's one trailing newline is dropped, as llama-perplexity's -f drops it.
    assert code == 0 and out["n_tokens"] == len(tok.encode(text[:-1], parse_special=False)) != len(parsed)
