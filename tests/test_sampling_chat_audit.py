"""Sampling and chat prompts against their references: llama.cpp's sampler definitions, greedy's
argmax, and the stream-equals-answer rule of docs/server.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.errors import NonFiniteLogitsError
from expertcache.gguf_tokenizer import tokenizer_parts_from_gguf
from expertcache.sampling import Sampler, SamplingParams
from expertcache.tokenizer import StreamDecoder, Tokenizer

RECORDED = Path(__file__).resolve().parent / "fixtures" / "gguf" / "tokenizers"


def test_top_k_keeps_exactly_k_tokens_when_logits_tie():
    """llama.cpp's top-k keeps exactly k candidates. bf16 logits tie at the top often (the bundled
    model's do at a few percent of steps), and keeping every tied token made top_k 1 a coin toss
    between them instead of the greedy token."""
    tied = torch.tensor([0.0, 2.0, 2.0, 1.0], dtype=torch.bfloat16)
    greedy = int(torch.argmax(tied))  # the first of the tied maxima
    assert Sampler(SamplingParams())(tied) == greedy == 1
    for seed in range(64):
        assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed))(tied) == greedy
    # [3, 2, 2, 1] with top_k 2: two candidates, ids 0 and 1; id 2 (tied with 1) is not one.
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0])
    seen = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=seed))(logits) for seed in range(200)}
    assert seen == {0, 1}
    # Beyond the tie nothing changes: top_k 3 keeps all three of the top values.
    seen = {Sampler(SamplingParams(temperature=1.0, top_k=3, seed=seed))(logits) for seed in range(200)}
    assert seen == {0, 1, 2}


def test_seed_minus_one_is_a_random_seed_as_in_llama_cpp(monkeypatch):
    """llama.cpp's `--seed` and llama-server's `seed` default to -1, "random": a client written for
    it sends -1 to sample afresh. Taken as an ordinary seed, every such request repeated one stream."""
    import expertcache.sampling as sampling

    drawn = iter([b"\x01" * 8, b"\x02" * 8])
    monkeypatch.setattr(sampling.os, "urandom", lambda n: next(drawn))
    seeds = [Sampler(SamplingParams(temperature=1.0, seed=-1)).gen.initial_seed() for _ in range(2)]
    assert seeds == [int.from_bytes(b"\x01" * 8) % 2**63, int.from_bytes(b"\x02" * 8) % 2**63]
    assert Sampler(SamplingParams(temperature=1.0, seed=-2)).gen.initial_seed() == torch.Generator().manual_seed(-2).initial_seed()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logits_holding_nan_or_infinity_are_refused(bad, temperature):
    """No token can be chosen from logits that overflowed: greedy took a NaN's position as the
    answer, and sampling failed inside torch with a traceback."""
    logits = torch.tensor([0.5, 2.0, bad, 1.0])
    with pytest.raises(NonFiniteLogitsError, match=f"logits hold {bad}"):
        Sampler(SamplingParams(temperature=temperature, seed=0))(logits)


def spm_tokenizer() -> Tokenizer:
    """A SentencePiece vocabulary with byte-fallback tokens <0x00>..<0xFF>, as llama.cpp's file holds it."""
    with GGUFCheckpoint(RECORDED / "spm-tiny.gguf") as ck:
        return Tokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))


def test_a_stream_through_an_invalid_byte_run_is_the_whole_answer():
    """Byte tokens CA AF (a whole 'ʯ') then C2 (a lead byte never completed), as a model may
    generate them. The streamed pieces and the final text (the non-streamed answer) must be one
    text, and that text is llama.cpp's: the pieces' bytes joined and decoded, an invalid byte one
    U+FFFD. tokenizers decodes the three bytes as one run and turned the emitted 'ʯ' into U+FFFD
    afterwards, so the stream and the answer disagreed."""
    tok = spm_tokenizer()
    byte = lambda b: tok.tok.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    context = tok.encode("The cat", add_special_tokens=False)
    out = [byte(0xCA), byte(0xAF), byte(0xC2), tok.tok.token_to_id("▁In")]
    dec = StreamDecoder(tok, context=context)
    streamed = "".join(dec.push(i) for i in out)
    assert dec.text() == streamed == b"\xca\xaf\xc2 In".decode("utf-8", errors="replace") == "ʯ\ufffd In"
    # Held back at the end (the lead byte is last): the rest of the answer continues the stream.
    dec = StreamDecoder(tok, context=context)
    streamed = "".join(dec.push(i) for i in out[:3])
    assert streamed == "ʯ" and dec.text() == "ʯ\ufffd"
