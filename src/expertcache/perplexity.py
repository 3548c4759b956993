"""Perplexity over a token stream, computed the way llama.cpp's `llama-perplexity` does by default.

The tokens are cut into consecutive chunks of `n_ctx`; each chunk runs from an empty KV cache, its
first token replaced by BOS where the tokenizer uses one, and the tokens predicted from positions
n_ctx/2 .. n_ctx-2 are scored (each with at least n_ctx/2 tokens of context). This module computes
numbers and prints nothing; `expertcache perplexity` is the command around it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import ExpertCacheError

# S = scored positions in a chunk, V = vocabulary.


def exp_nll(mean: float) -> float:
    """exp(mean NLL): inf where it overflows a double (math.exp raises there), as llama-perplexity's
    std::exp prints it: a model far off on the text still reports, and does not crash."""
    try:
        return math.exp(mean)
    except OverflowError:
        return math.inf


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """One chunk: the sum of the scored tokens' negative log-likelihoods (fp64), of their squares,
    and how many tokens were scored."""

    index: int
    nll: float
    nll2: float
    count: int
    seconds: float

    @property
    def ppl(self) -> float:
        return exp_nll(self.nll / self.count)


@dataclass(slots=True)
class PerplexityResult:
    n_ctx: int
    n_tokens: int  # in the whole text
    bos_id: int | None  # the id written over each chunk's first token, or None
    chunks: list[ChunkResult]

    @property
    def count(self) -> int:
        return sum(c.count for c in self.chunks)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.chunks)

    def cumulative(self) -> list[float]:
        """PPL over chunks 1..k for each k: the running values llama-perplexity prints."""
        out, nll, n = [], 0.0, 0
        for c in self.chunks:
            nll, n = nll + c.nll, n + c.count
            out.append(exp_nll(nll / n))
        return out

    @property
    def ppl(self) -> float:
        return exp_nll(sum(c.nll for c in self.chunks) / self.count)

    @property
    def uncertainty(self) -> float | None:
        """llama-perplexity's error of the final PPL: PPL * sqrt(var(nll) / (N - 1)), where var is
        the population variance of the per-token NLL. None when that variance is not positive (the
        case where llama-perplexity reports an error instead)."""
        n = self.count
        mean = sum(c.nll for c in self.chunks) / n
        var = sum(c.nll2 for c in self.chunks) / n - mean * mean
        if not var > 0 or n < 2:
            return None
        return math.sqrt(var / (n - 1)) * exp_nll(mean)


def num_chunks(n_tokens: int, n_ctx: int, max_chunks: int | None = None) -> int:
    """How many chunks llama-perplexity evaluates: n_tokens // n_ctx, at least 2 required."""
    if n_ctx < 3:
        raise ExpertCacheError(f"context {n_ctx} is too small: perplexity needs a context of at least 3 tokens")
    if n_tokens < 2 * n_ctx:
        raise ExpertCacheError(f"the text has {n_tokens} tokens; a context of {n_ctx} needs at least "
                               f"{2 * n_ctx} (2 x n_ctx): give a longer text or a smaller -c/--ctx-size")
    if max_chunks is not None and max_chunks < 1:
        raise ExpertCacheError(f"chunks {max_chunks} must be at least 1")
    n = n_tokens // n_ctx
    return n if max_chunks is None else min(n, max_chunks)


def perplexity_bos_id(tokenizer) -> int | None:
    """The BOS id llama-perplexity writes over each chunk's first token: set where the tokenizer
    adds BOS when encoding (llama.cpp's add_bos), else None."""
    bos = getattr(tokenizer, "bos_id", None)
    if bos is None:
        return None
    if getattr(tokenizer, "add_bos", False):
        return bos
    # tokenizer.json's own post-processor may add it even without add_bos_token.
    return bos if tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else None


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per row, as llama-perplexity computes it: fp32 logits, max and exp in fp32,
    the sum of exps and the log in fp64. logits [S, V], targets [S] -> [S] fp64."""
    x = logits.float()                                             # [S, V]
    top = x.amax(dim=-1, keepdim=True)                             # [S, 1]
    sum_exp = torch.exp(x - top).double().sum(dim=-1)              # [S]
    picked = (x.gather(1, targets[:, None]) - top).squeeze(1)      # [S] fp32
    return torch.log(sum_exp) - picked.double()                    # [S]


def perplexity(model, token_ids: list[int], n_ctx: int = 512, ubatch: int = 512,
               max_chunks: int | None = None, bos_id: int | None = None,
               on_chunk: Callable[[ChunkResult], None] | None = None) -> PerplexityResult:
    """Evaluate `token_ids` in consecutive chunks of `n_ctx`, each from an empty KV cache.

    `bos_id` (see `perplexity_bos_id`) replaces each chunk's first token. `on_chunk` is called
    after each chunk (progress). The model's context must hold `n_ctx` tokens.
    """
    n_chunks = num_chunks(len(token_ids), n_ctx, max_chunks)
    if model.ctx_size < n_ctx:
        raise ExpertCacheError(f"context {n_ctx} does not fit the model's context of {model.ctx_size} "
                               "(load it with ctx_size >= n_ctx)")
    first = n_ctx // 2
    model.begin_call()
    result = PerplexityResult(n_ctx, len(token_ids), bos_id, [])
    for i in range(n_chunks):
        chunk = list(token_ids[i * n_ctx: (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        t0 = time.perf_counter()
        logits = model.prefill(model.new_session(), chunk, ubatch, all_logits=True)  # [n_ctx, V]
        # Position j predicts token j+1; score j = first .. n_ctx-2. Targets are the original
        # tokens (a chunk's first token is never a target).
        targets = torch.as_tensor(chunk[first + 1:], dtype=torch.long, device=logits.device)  # [S]
        nll = token_nll(logits[first: n_ctx - 1], targets).tolist()
        seconds = time.perf_counter() - t0
        # Sequential fp64 sums: the same order in every mode, so equal logits give equal bits.
        res = ChunkResult(i, sum(nll), sum(v * v for v in nll), len(nll), seconds)
        result.chunks.append(res)
        if on_chunk is not None:
            on_chunk(res)
    return result


def first_difference(results: dict[str, PerplexityResult]) -> int | None:
    """Index of the first chunk whose NLL sum is not bitwise equal across all results, or None."""
    runs = list(results.values())
    n = min(len(r.chunks) for r in runs)
    for i in range(n):
        if len({r.chunks[i].nll.hex() for r in runs}) > 1:
            return i
    if any(len(r.chunks) != n for r in runs):
        return n
    return None
