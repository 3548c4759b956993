"""`expertcache perplexity` against llama-perplexity's definition (tools/perplexity/perplexity.cpp),
recomputed here by hand from the model's logits with llama.cpp's arithmetic; how it reads the file
(common/arg.cpp's -f); and what an interrupted run says."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

import expertcache
import expertcache.perplexity as ppl_module
from conftest import VOCAB
from expertcache.cli import main

ASSETS = Path(expertcache.__file__).parent / "assets"
BUNDLED_MODEL, HELDOUT = ASSETS / "tiny-qwen3-moe", ASSETS / "heldout.txt"


def write_words(path: Path, n_words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.write_text(" ".join(f"w{rng.randrange(VOCAB - 4)}" for _ in range(n_words)))


def hand_nll(logits: np.ndarray, target: int) -> float:
    """-log p(target) as llama-perplexity's log_softmax: the max and each exp in fp32 (expf, here
    exp correctly rounded to fp32), the sum of exps a sequential fp64 sum, the log in fp64."""
    row = logits.astype(np.float32)
    top = np.float32(row.max())
    sum_exp = 0.0
    for v in row:
        sum_exp += float(np.float32(math.exp(float(np.float32(v - top)))))
    return math.log(sum_exp) - float(np.float32(row[target] - top))


def hand_perplexity(model, ids: list[int], n_ctx: int, max_chunks: int, bos: int | None = None):
    """llama-perplexity's loop by hand: chunks of n_ctx from an empty cache, BOS over each chunk's
    first token, tokens predicted from positions n_ctx/2 .. n_ctx-2 scored; the running PPL after
    each chunk and the final estimate's uncertainty. Returns (chunk NLL sums, chunk counts, running
    values, uncertainty)."""
    first = n_ctx // 2
    sums, counts, running = [], [], []
    nll = nll2 = 0.0
    count = 0
    for i in range(min(len(ids) // n_ctx, max_chunks)):
        chunk = ids[i * n_ctx: (i + 1) * n_ctx]
        inp = ([bos] if bos is not None else chunk[:1]) + chunk[1:]
        logits = model.logits(inp).float().numpy()  # [n_ctx, V]
        chunk_sum = 0.0
        for j in range(first, n_ctx - 1):
            v = hand_nll(logits[j], chunk[j + 1])
            chunk_sum += v
            nll2 += v * v
        sums.append(chunk_sum)
        counts.append(n_ctx - 1 - first)
        nll += chunk_sum
        count += n_ctx - 1 - first
        running.append(math.exp(nll / count))
    mean, mean2 = nll / count, nll2 / count
    return sums, counts, running, math.exp(mean) * math.sqrt((mean2 - mean * mean) / (count - 1))


@pytest.mark.parametrize("n_ctx,bos", [(15, False), (16, True)], ids=["odd-ctx", "bos"])
def test_json_matches_a_hand_computation_from_the_logits(tiny_checkpoint, tmp_path, capsys, n_ctx, bos):
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    if bos:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(bos_token="<|im_start|>", add_bos_token=True)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    f = tmp_path / "text.txt"
    write_words(f, 4 * n_ctx + 5)
    code = main(["perplexity", "-m", str(d), "-f", str(f), "-c", str(n_ctx), "--chunks", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    model = expertcache.load(d)
    ids = model.tokenizer.encode(f.read_text(), parse_special=False)
    sums, counts, running, unc = hand_perplexity(model, ids, n_ctx, 3, bos=2 if bos else None)
    assert code == 0
    assert out["n_tokens"] == len(ids) and out["chunks"] == 3 and out["bos_id"] == (2 if bos else None)
    assert out["chunk_tokens"] == counts == [n_ctx - 1 - n_ctx // 2] * 3 and out["scored_tokens"] == sum(counts)
    assert out["chunk_nll"] == pytest.approx(sums, rel=1e-8)
    assert out["ppl_cumulative"] == pytest.approx(running, rel=1e-8)
    assert out["ppl"] == out["ppl_cumulative"][-1]
    assert out["ppl_uncertainty"] == pytest.approx(unc, rel=1e-7)


def text_of_tokens(tok, n: int) -> str:
    """A prefix of the held-out text, ending in a letter, that tokenizes to n tokens and to n + 1
    with a newline after it."""
    text = HELDOUT.read_text(encoding="utf-8")
    for end in range(1, len(text)):
        t = text[:end]
        if not t[-1].isalpha():
            continue
        k = len(tok.encode(t, parse_special=False))
        if k > n:
            break
        if k == n and len(tok.encode(t + "\n", parse_special=False)) == n + 1:
            return t
    raise AssertionError(f"no prefix of {HELDOUT} has {n} tokens")


def test_one_trailing_newline_is_dropped_as_llama_perplexity_does(tmp_path, capsys):
    # common/arg.cpp reads -f whole and drops one final '\n' before llama-perplexity tokenizes it:
    # a text of 2*n_ctx - 1 tokens and a newline is too short there, and the token count is the
    # text's without it.
    from expertcache.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_MODEL)
    t = text_of_tokens(tok, 31)
    f = tmp_path / "t.txt"
    f.write_text(t + "\n")
    code = main(["perplexity", "-m", str(BUNDLED_MODEL), "-f", str(f), "-c", "16", "--json"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "the text has 31 tokens; a context of 16 needs at least 32" in err, err
    t = text_of_tokens(tok, 40)
    for tail, n_tokens in (("\n", 40), ("\n\n", len(tok.encode(t + "\n", parse_special=False)))):
        f.write_text(t + tail)  # only the last newline goes
        code = main(["perplexity", "-m", str(BUNDLED_MODEL), "-f", str(f), "-c", "16", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["n_tokens"] == n_tokens


@pytest.mark.parametrize("compare", [False, True], ids=["one-mode", "compare"])
def test_ctrl_c_says_where_it_stopped_in_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch, compare):
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    f = tmp_path / "text.txt"
    write_words(f, 3 * 16)
    real, calls = ppl_module.token_nll, []
    # Ctrl-C while the third chunk is scored; with --compare, the first mode's three chunks done,
    # while the second mode's first is
    stop_at = 4 if compare else 3

    def token_nll(logits, targets):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(logits, targets)

    monkeypatch.setattr(ppl_module, "token_nll", token_nll)
    argv = ["perplexity", "-m", str(d), "-f", str(f), "-c", "16"]
    if compare:
        argv += ["--compare", "resident,cache"]
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 130 and captured.out == "" and len(lines) == 1, captured.err
    if compare:
        assert lines[0] == "expertcache: perplexity interrupted in cache before the first chunk of 3"
        return
    m = re.fullmatch(r"expertcache: perplexity interrupted after 2 of 3 chunks "
                     r"\(PPL over them (\d+\.\d{4}), not a final estimate\)", lines[0])
    assert m, lines[0]
    model = expertcache.load(d)
    ids = model.tokenizer.encode(f.read_text(), parse_special=False)
    _, _, running, _ = hand_perplexity(model, ids, 16, 2)
    assert float(m.group(1)) == pytest.approx(running[1], abs=1e-4)


def test_chunks_minus_one_is_every_chunk_as_in_llama_perplexity(tmp_path, capsys):
    from expertcache.tokenizer import Tokenizer

    f = tmp_path / "t.txt"
    f.write_text(text_of_tokens(Tokenizer(BUNDLED_MODEL), 50))
    outs = []
    for extra in ([], ["--chunks", "-1"], ["--chunks", "2"]):
        assert main(["perplexity", "-m", str(BUNDLED_MODEL), "-f", str(f), "-c", "16", "--json", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["chunks"] == outs[1]["chunks"] == 3 and outs[2]["chunks"] == 2
    assert outs[0]["chunk_nll"] == outs[1]["chunk_nll"]
    from conftest import assert_one_line_error, run_cli

    for bad in ("-2", "0"):
        assert_one_line_error(*run_cli(capsys, "perplexity", "-m", str(BUNDLED_MODEL), "-f", str(f), "--chunks", bad),
                              "--chunks")


def test_an_empty_compare_is_refused_not_ignored(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("w1 w2")
    code = main(["perplexity", "-m", str(BUNDLED_MODEL), "-f", str(f), "--compare", ""])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "give at least two different cache modes" in err
