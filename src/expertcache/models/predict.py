"""Predict which experts the next MoE layer will use, before its router runs (for prefetch).

The default predictor needs nothing trained: at MoE layer l, once l's mixer has run (the
decoder's `residual_hook`), it applies the router of the next MoE layer l' (with l''s own
router-input normalisation) to the residual stream h and ranks l''s experts for each token. The
residual changes little from one layer to the next, so this ranks l''s experts much as l''s router
will. The first MoE layer of a forward is predicted from the tokens' embeddings alone
(`predict_first`, at the start of the forward, once the tokens are known). Where asked
(`scored`: a trace recorder, or `--prefetch-min-prob`), each ranked expert comes with the
probability the predictor gives it (the router's softmax here), rounded to float16 as a trace
stores it, so that `--prefetch-min-prob` drops the same guesses in the runtime and in a replay.
Predicting only reads the hidden state: outputs are the same with and without it.

T = tokens, D = hidden, E = experts per layer, P = experts ranked per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import check_min_prob
from ..errors import ExpertCacheError
from .parallel_ffn import ParallelFFN


def next_moe_layers(moe_layers: Sequence[int]) -> dict[int, int]:
    """Each MoE layer -> the next one (the last has none)."""
    return dict(zip(moe_layers, moe_layers[1:]))


def router_input(decoder, layer: int, h: torch.Tensor) -> torch.Tensor:
    """The residual h [T, D] as layer `layer`'s router sees it: [T, D] in the model's dtype.

    Qwen-family layers route norm(h, post_norm) @ router.T; Gemma 4's block (`ParallelFFN`) routes
    rms(h) * scale * D^-0.5 @ router.T.
    """
    lw = decoder.weights.layers[layer]
    if lw.router is None:
        raise ExpertCacheError(f"layer {layer} has no router: only MoE layers can be predicted")
    if lw.block is None:
        return decoder.norm(h, lw.post_norm, decoder.cfg.rms_norm_eps)  # [T, D]
    if isinstance(lw.block, ParallelFFN):
        return lw.block.router_input(decoder.kernels, h, lw.block_w)  # [T, D]
    raise ExpertCacheError(f"layer {layer}: no predictor for a feed-forward block of type "
                           f"{type(lw.block).__name__}")


def router_probs(decoder, layer: int, h: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s router applied to the residual h [T, D] as that layer's router would see it:
    probabilities [T, E] in fp32, whose ranking is the router's."""
    x = router_input(decoder, layer, h)
    return torch.softmax(decoder.kernels.linear(x, decoder.weights.layers[layer].router), dim=-1,
                         dtype=torch.float)  # [T, E]


def embedded(decoder, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream the first layer starts from: tokens [T] -> [T, D]."""
    return decoder.embed(tokens)


def rank_experts(probs: torch.Tensor, n: int) -> torch.Tensor:
    """The n most probable experts of each token, best first: [T, n] ids (ties: the router's order)."""
    return torch.topk(probs, n, dim=-1).indices  # [T, n]


class RouterPredictor:
    """The default predictor. Attach it as the decoder's `residual_hook` and call `predict_first`
    with each forward's tokens before the forward; `take(layer)` then hands out the prediction for
    the op of `layer` about to run: ([T, P] expert ids, each token's P best first; with `scored`,
    their probabilities [T, P] float16, else None), or None when that layer was not predicted in
    this forward. The probabilities cost a gather per layer and token, so only who compares or
    records them asks for them.
    """

    name = "router"

    def __init__(self, decoder, width: int, scored: bool = True):
        moe = list(decoder.cfg.moe_layers)
        E = decoder.cfg.num_experts
        if not isinstance(width, int) or not 1 <= width <= E:
            raise ExpertCacheError(f"prediction width must be an integer in [1, {E}] experts, got {width!r}")
        self.decoder, self.width, self.scored = decoder, width, scored
        self.first = moe[0]
        self.next = next_moe_layers(moe)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def rank(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MoE layer `layer`'s experts ranked for the residual h [T, D] of an earlier layer (or the
        embeddings): ([T, width] ids, best first; their probabilities [T, width] float16 or None)."""
        return self._ranked(router_probs(self.decoder, layer, h))

    def _ranked(self, scores: torch.Tensor, probabilities=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The `width` best experts of each token by `scores` [T, E]; with `scored`, their
        probabilities (`probabilities(scores)`, or the scores themselves), gathered, in float16."""
        ids = rank_experts(scores, self.width)
        if not self.scored:
            return ids, None
        probs = scores if probabilities is None else probabilities(scores)
        return ids, probs.gather(-1, ids).to(torch.float16)

    @torch.inference_mode()
    def __call__(self, layer: int, h: torch.Tensor) -> None:
        """The residual hook: h [T, D] after `layer`'s mixer ranks the next MoE layer's experts."""
        nxt = self.next.get(layer)
        if nxt is not None and self.decoder.weights.layers[layer].router is not None:
            self._pending[nxt] = self.rank(nxt, h)

    @torch.inference_mode()
    def predict_first(self, tokens: torch.Tensor) -> None:
        """Rank the first MoE layer's experts for tokens [T] from their embeddings alone."""
        self._pending[self.first] = self.rank(self.first, embedded(self.decoder, tokens))

    def take(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self._pending.pop(layer, None)

    def peek(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The prediction `take` would hand out, left in place."""
        return self._pending.get(layer)

    def clear(self) -> None:
        self._pending.clear()


def op_prediction(ranked: Sequence[Sequence[int]], n: int, probs: Sequence[Sequence[float]] | None = None,
                  min_prob: float = 0.0) -> list[int]:
    """One op's prediction from its tokens' ranked experts ([T][>= n] ids, best first): the union of
    each token's n best, ordered by best rank over the tokens, then id (the order a prefetch
    plans them in when room runs out). With `probs` ([T][>= n], each ranked expert's probability),
    a token's expert counts only if its probability is at least `min_prob`."""
    out: list[int] = []
    seen: set[int] = set()
    for r in range(n):
        if probs is None:
            here = {int(row[r]) for row in ranked}
        else:
            here = {int(row[r]) for row, p in zip(ranked, probs) if p[r] >= min_prob}
        for e in sorted(here - seen):
            seen.add(e)
            out.append(e)
    return out


def width_experts(width: float, top_k: int, limit: int) -> int:
    """`--prefetch-width` W (a multiple of top-k) as experts per token: ceil(W k), at most `limit`."""
    if not width >= 0:
        raise ExpertCacheError(f"prefetch width must be a number >= 0 (a multiple of top-k), got {width!r}")
    return min(limit, math.ceil(width * top_k - 1e-9))


class NextOpPredictions:
    """What a prefetching cache plans: the predicted experts of each MoE op, named when the op
    before it is planned (docs/cache.md, "Prefetch").

    `attach()` makes a `RouterPredictor` ranking `width_experts(width)` experts per token (the
    fitted `LinearPredictor` where `maps` are given) the decoder's residual hook, and `begin` its forward hook. The predictions are read from whatever
    `RouterPredictor` is the residual hook at the time (a trace recorder's while it records), so
    that what a recorded trace says was predicted is what was prefetched. `begin(tokens)` plans the
    first MoE layer's prediction at the start of a forward (`plan(layer, experts)`); `self(layer)`,
    the cache's `predict`, names the next MoE layer's once `layer`'s op is planned.
    """

    def __init__(self, decoder, width: float, plan, maps=None, min_prob: float = 0.0):
        from .linear_predictor import make_predictor

        cfg = decoder.cfg
        self.decoder, self.plan = decoder, plan
        self.min_prob = check_min_prob(min_prob)
        self.n = width_experts(width, cfg.top_k, cfg.num_experts)
        self.own = make_predictor(decoder, self.n, maps, scored=self.min_prob > 0) if self.n else None
        self.first = cfg.moe_layers[0]
        self.next = next_moe_layers(cfg.moe_layers)

    def attach(self, residual: bool = True) -> None:
        """Hook into the decoder (the residual hook only with `residual`: another may hold it)."""
        if residual:
            self.decoder.residual_hook = self.own
        self.decoder.forward_hook = self.begin

    def _source(self) -> RouterPredictor | None:
        hook = self.decoder.residual_hook
        return hook if isinstance(hook, RouterPredictor) and hook.decoder is self.decoder else None

    def _experts(self, source: RouterPredictor, layer: int) -> list[int] | None:
        got = source.peek(layer)  # [T, P] ids and probabilities
        if got is None or not self.n:
            return None
        ranked, probs = got
        n = min(self.n, ranked.shape[1])
        if self.min_prob > 0:
            return op_prediction(ranked[:, :n].tolist(), n, probs[:, :n].tolist(), self.min_prob)
        return op_prediction(ranked[:, :n].tolist(), n)

    def begin(self, tokens: torch.Tensor) -> None:
        source = self._source()
        if source is None:
            return
        if source is self.own:  # a recorder ranks the first layer itself, before the forward
            source.clear()
            source.predict_first(tokens)
        experts = self._experts(source, self.first)
        if experts:
            self.plan(self.first, experts)

    def __call__(self, layer: int) -> tuple[int, list[int]] | None:
        nxt = self.next.get(layer)
        source = self._source() if nxt is not None else None
        experts = self._experts(source, nxt) if source is not None else None
        return (nxt, experts) if experts else None
