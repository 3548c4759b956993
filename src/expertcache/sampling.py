"""Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

from .errors import ExpertCacheError, NonFiniteLogitsError

# torch.Generator.manual_seed takes any integer that fits 64 bits, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None   # None or -1 (llama.cpp's default, "random"): one from the OS

    def __post_init__(self) -> None:
        # Types first: from the Python API a str or float would otherwise pass as a TypeError from a
        # comparison here, or from torch after the whole prompt was processed (top_k, seed).
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ExpertCacheError(f"{name} {value!r} must be a number")
        for name, value in (("top_k", self.top_k), ("seed", 0 if self.seed is None else self.seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ExpertCacheError(f"{name} {value!r} must be an integer")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ExpertCacheError(f"temperature {self.temperature} must be a finite number >= 0")
        if self.top_k < 0:
            raise ExpertCacheError(f"top_k {self.top_k} must be >= 0")
        if not 0 <= self.top_p <= 1:
            raise ExpertCacheError(f"top_p {self.top_p} must be in [0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ExpertCacheError(f"min_p {self.min_p} must be in [0, 1]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ExpertCacheError(f"seed {self.seed} must be in [{SEED_MIN}, {SEED_MAX}] (64 bits)")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        # Without a seed, one from the OS: torch.seed() would reseed torch's global generator too,
        # undoing a caller's torch.manual_seed for everything that follows.
        # -1 asks for a random seed in llama.cpp (`--seed`, and llama-server's `seed`): a client
        # written for it sends -1 to sample afresh, not to repeat one fixed stream.
        random = params.seed is None or params.seed == -1
        self.gen.manual_seed(int.from_bytes(os.urandom(8)) % 2**63 if random else int(params.seed))

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        p = self.p
        if p.temperature == 0:
            i = int(torch.argmax(logits))  # a NaN or +inf anywhere is where argmax lands
            _check_finite(float(logits[i]))
            return i
        logits = logits.float()
        top = logits.max()  # NaN anywhere makes it NaN
        _check_finite(float(top))
        if p.top_k and p.top_k < logits.shape[0]:
            logits = logits.masked_fill(~_top_k_mask(logits, int(p.top_k)), float("-inf"))
        # Shifted so that the largest logit is 0 before dividing, and the temperature kept a normal
        # float32: however small the temperature, the others go to -inf at worst (probability 0)
        # and nothing becomes +inf or NaN (0 / 0). (top-k keeps the largest.)
        logits = (logits - top) / max(p.temperature, _TINY)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p, and always the most probable
            # token: top_p 0 keeps it alone, as OpenAI and llama.cpp read it.
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            drop[0] = False
            probs = probs.scatter(0, idx[drop], 0.0)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.gen))


def _check_finite(top: float) -> None:
    """The largest logit, NaN where any is: none can be chosen from logits that overflowed."""
    if not math.isfinite(top):
        raise NonFiniteLogitsError(f"the model's logits hold {top} (an overflow in the forward pass, as fp16 "
                                   f"can give): no token can be chosen; try --dtype bfloat16 or float32")


def _top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k most likely tokens, exactly k as llama.cpp keeps them: logits that tie at the k-th
    value are kept from the lowest id on, the tie greedy's argmax breaks, so that top_k 1 samples
    the greedy token (bf16 logits tie at the top often enough to matter). Read on the logits as
    given: dividing by a temperature could round two neighbouring values into one."""
    kth = torch.topk(logits, k).values[-1]
    keep = logits > kth
    tied = torch.nonzero(logits == kth).flatten()
    keep[tied[: k - int(keep.sum())]] = True
    return keep
