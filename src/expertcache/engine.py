"""The engine: load a checkpoint, run forwards, prefill in micro-batches, decode, sample.

The engine works on token ids; text goes through `Tokenizer`. A `Session` holds the token ids
and KV state of one conversation so that a later call can reuse its longest common prefix.
"""

from __future__ import annotations

import json
import numbers
import operator
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import CacheConfig, ModelConfig, RopeOverride, parse_dtype
from .errors import ExpertCacheError
from .kernels import Kernels
from .kernels import select as select_kernels
from .models.decoder import Decoder, PrefillStopped
from .models.layers import KVCache
from .models.loader import load_dense, open_model
from .models.predict import NextOpPredictions
from .models.state import SnapshotSchedule
from .tiers import build_experts, make_store_for
from .tiers.cache import ExpertCache
from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class Session:
    """Token ids whose keys and values `kv` holds: one conversation's state. `version` is the
    model's weights version the state was computed with: state from other weights is never reused."""

    kv: KVCache
    tokens: list[int] = field(default_factory=list)
    version: int = 0
    # The model whose `new_session` made it: another model's KV state has other shapes and
    # other weights, and is never reused (None: built by hand, not checked).
    owner: object = field(default=None, repr=False, compare=False)

    def copy(self) -> Session:
        return Session(self.kv.copy(), list(self.tokens), self.version, self.owner)

    def truncate(self, n: int) -> int:
        """Keep at most the first n tokens; returns how many were kept (fewer than n where a
        recurrent state could only be restored from an earlier snapshot)."""
        # A negative n would set the KV length below 0 and cut the token list from its end.
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ExpertCacheError(f"truncate({n!r}): expected a token count >= 0")
        n = self.kv.truncate(int(n))
        del self.tokens[n:]
        return n


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # stop | length | abort (the on_text callback or should_stop asked to stop)
    prompt_seconds: float
    gen_seconds: float
    # Prompt tokens run: those not reused, unless the prompt was stopped part-way (None).
    processed_tokens: int | None = None

    @property
    def prompt_processed(self) -> int:
        return self.prompt_tokens - self.cached_tokens if self.processed_tokens is None else self.processed_tokens

    @property
    def prompt_tps(self) -> float:
        return self.prompt_processed / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return len(self.token_ids) / self.gen_seconds if self.gen_seconds > 0 else 0.0

    def timings(self) -> dict:
        return {"prompt_n": self.prompt_processed, "cache_n": self.cached_tokens,
                "predicted_n": len(self.token_ids), "prompt_ms": self.prompt_seconds * 1e3,
                "predicted_ms": self.gen_seconds * 1e3, "prompt_per_second": self.prompt_tps,
                "predicted_per_second": self.gen_tps}


@dataclass(frozen=True)
class PrefillStats:
    """What the last prefill did: tokens, stretches, expert bytes read from the slow tier."""

    tokens: int = 0
    stretches: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0

    def __add__(self, other: PrefillStats) -> PrefillStats:
        return PrefillStats(self.tokens + other.tokens, self.stretches + other.stretches,
                            self.bytes_read + other.bytes_read, self.seconds + other.seconds)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "stretches": self.stretches, "bytes_read": self.bytes_read,
                "bytes_read_per_token": self.bytes_per_token, "seconds": self.seconds}


def plan_stretch(bytes_per_token: int, stretch: int, mem: int) -> int:
    """The prefill stretch: `stretch` tokens, or fewer (with one notice line) when their
    activations, `bytes_per_token` each, would take more than `mem` bytes."""
    if mem < bytes_per_token:  # not even one token fits: a 1-token stretch would still exceed it
        raise ExpertCacheError(f"prefill-mem {mem} bytes is less than one token's activations "
                               f"({bytes_per_token} bytes) for this model")
    fit = mem // max(1, bytes_per_token)
    if stretch <= fit:
        return stretch
    print(f"expertcache: prefill stretch cut from {stretch} to {fit} tokens: {stretch} would need "
          f"{_mib(stretch * bytes_per_token)} of activations, over the {_mib(mem)} allowed (--prefill-mem)",
          file=sys.stderr, flush=True)
    return fit


def _mib(n: int) -> str:
    """Bytes in MiB, or KiB below one MiB (a small budget read '0 MiB')."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class LoadOptions:
    """Everything a model was loaded with; a reload after the checkpoint changes uses the same."""

    device: torch.device
    dtype: torch.dtype | None  # None: the checkpoint's
    cache: CacheConfig
    ctx_size: int | None
    kernels: str
    prefill_stretch: int = 4096  # tokens per load of each expert in a long prefill (`Model.prefill`)
    prefill_mem: int = 2 << 30   # bytes a stretch's activations may take; a longer stretch is cut
    activations: str = "auto"    # products with quantized weights: exact, or rounded to 8 bits (q8)
    rope: RopeOverride | None = None  # a RoPE scaling over the checkpoint's own


class Model:
    """A loaded model: `logits`, `generate`, `chat`, and the tokenizer."""

    def __init__(self, path: Path, options: LoadOptions, cfg: ModelConfig, net: Decoder,
                 tokenizer: Tokenizer | None, experts: ExpertCache):
        self.path, self.options, self.cfg, self.net, self.tokenizer = path, options, cfg, net, tokenizer
        self.ctx_size = options.ctx_size or cfg.max_position
        self.experts = experts  # the expert provider: the slot cache over the slow tier
        # Bumped at each reload: everything computed from the weights records it (sessions).
        self.version = 0
        self.eos_ids = set(cfg.eos_token_id)
        if tokenizer is not None:
            self.eos_ids |= tokenizer.end_ids
        # What the last prefill and all of them so far read from the slow tier (telemetry).
        self.last_prefill = self.prefill_total = PrefillStats()
        self.stretch = plan_stretch(net.activation_bytes(1), options.prefill_stretch, options.prefill_mem)
        # Fitted maps that predict in place of the routers (`CacheConfig.predictor`), checked
        # against this model's routers now; None: the routers predict.
        self.predictor_maps = self._load_maps(options.cache.predictor)
        # Prefetch hooks make the decoder and the cache refer to each other (`_wire_prefetch`):
        # dropped, the model would leave them, the slot pool with them (VRAM on a GPU, where
        # prefetch is on by default), to the cycle collector. They are unhooked when it goes.
        self._hooked: dict = {}
        weakref.finalize(self, _unhook_prefetch, self._hooked)

    @property
    def kernels(self) -> Kernels:
        return self.net.kernels

    # ---- state ----
    def new_session(self) -> Session:
        return Session(self.net.new_kv(self.ctx_size), version=self.version, owner=self)

    def telemetry(self) -> dict:
        return self.experts.telemetry()

    def resize_cache(self, cache: CacheConfig) -> None:
        """Reallocate the expert cache at another size, mode, policy or prefetch; its slots are
        invalidated (reason `pool`). The store stays the one the model was loaded with: a config
        left at the default store takes it, one naming another store is refused."""
        if not isinstance(cache, CacheConfig):
            raise ExpertCacheError(f"resize_cache takes a CacheConfig, got {type(cache).__name__}")
        maps = self._load_maps(cache.predictor)  # before anything changes: a bad file changes nothing
        self.experts.resize(cache)
        self.predictor_maps = maps
        self._wire_prefetch()

    def _wire_prefetch(self, residual: bool = True) -> None:
        """With prefetch active, the cache asks the next op's prediction of a `NextOpPredictions`
        on this decoder (its residual hook too, unless `residual` is False: another holds it)."""
        ours = self.experts.predict if isinstance(self.experts.predict, NextOpPredictions) else None
        if ours is not None:  # unhook the previous one, if it still is the decoder's
            if self.net.residual_hook is ours.own:
                self.net.residual_hook = None
            if self.net.forward_hook == ours.begin:
                self.net.forward_hook = None
            self.experts.predict = None
        # Whether prefetch is on can depend on the maps (`auto` on a CPU): check them first, once.
        self.experts.fitted_predictor = self.predictor_maps is not None
        maps = self._maps_for(self.net) if self.experts.prefetching else None
        self.experts.fitted_predictor = maps is not None
        if self.experts.prefetching:
            config = self.experts.config
            predictions = NextOpPredictions(self.net, config.prefetch_width, self.experts.prefetch,
                                            maps, config.prefetch_min_prob)
            predictions.attach(residual=residual)
            self.experts.predict = predictions
        self._hooked.update(net=self.net, experts=self.experts)

    def _load_maps(self, path):
        if path is None:
            return None
        from .models.linear_predictor import LinearMaps

        maps = LinearMaps.load(path)
        maps.check(self.net)
        return maps

    def _maps_for(self, net: Decoder):
        """The fitted maps, where they still fit `net`: a reload that changed the routers (the
        checkpoint was rewritten) falls back to the routers with one notice; predictions only
        steer prefetch, never the results."""
        if self.predictor_maps is None:
            return None
        try:
            self.predictor_maps.check(net)
        except ExpertCacheError as e:
            print(f"notice: {e}; the routers predict from now on", file=sys.stderr)
            self.predictor_maps = None
        return self.predictor_maps

    def begin_call(self) -> None:
        """Start a top-level call (a forward, a generation, a perplexity run)."""
        # The checkpoint is checked at the start of each top-level call: if it changed on disk,
        # the weights are read again and exactly the stale slots are invalidated.
        if self.experts.source_changed():
            self._reload()

    def _reload(self) -> None:
        old = self.net
        self.cfg, self.net, _ = _assemble(self.path, self.options, old.kernels, self.experts)
        self.net.routing_hook, self.net.routing_override, self.net.residual_hook, self.net.timer = (
            old.routing_hook, old.routing_override, old.residual_hook, old.timer)
        self.net.forward_hook = old.forward_hook
        ours = self.experts.predict
        if isinstance(ours, NextOpPredictions):  # the predictor reads the new weights' routers
            own = old.residual_hook is ours.own
            self._wire_prefetch(residual=own)
        _unhook_prefetch({"net": old})  # its hooks, now the new decoder's, would keep it (and its weights)
        self.version += 1
        # Other weights may take more per token (a wider model, more experts per token): the
        # stretch planned for the old ones would run over --prefill-mem.
        self.stretch = plan_stretch(self.net.activation_bytes(1), self.options.prefill_stretch,
                                    self.options.prefill_mem)

    # ---- forwards ----
    def logits(self, token_ids, ubatch: int = 512) -> torch.Tensor:
        """The logits [T, V] of token_ids run from an empty context; no state is kept.

        The tokens run as `prefill(session, token_ids, ubatch, all_logits=True)` runs them, on a
        session made for the call and dropped after it: in stretches of `self.stretch` tokens
        (so a long input keeps to --prefill-mem as a prompt does), attention in micro-batches of
        `ubatch`. Up to `ubatch` tokens (and no more than a stretch) that is one forward over all
        of them, as this always was. Past that the split sums and products (attention per
        micro-batch, a recurrent layer's state carried between them, the MoE ops per stretch)
        may round otherwise than one forward would: the same values within float rounding, not
        always the same bits. The call counts as a prefill in `last_prefill`/`prefill_total`."""
        ubatch = _check_ubatch(ubatch)
        ids = self._id_list(token_ids)
        if not ids:
            raise ExpertCacheError("nothing to process: no token ids")
        self._check_fits(len(ids))
        self.begin_call()  # before the session: a reload changes the decoder and the version
        return self.prefill(self._scratch_session(len(ids)), ids, ubatch=ubatch, all_logits=True)

    def _scratch_session(self, n: int) -> Session:
        """A session for one call of n tokens, dropped after it (`logits`)."""
        # Sized to the input, as the one forward's state was: a sliding layer's ring no longer
        # than the tokens, the keys and values reserved once at n.
        kv = self.net.new_kv(n)
        if isinstance(kv, SnapshotSchedule):
            # Snapshots let a later call resume from a prefix, and nothing resumes from here: at
            # each micro-batch end of a long input they were copies of every recurrent state or
            # ring (Qwen3.6: about 63 MiB each, 8 kept) held to no end.
            kv.max_snapshots = 1
        return Session(kv, version=self.version, owner=self)

    def prefill(self, session: Session, token_ids: list[int], ubatch: int = 512,
                all_logits: bool = False, should_stop: Callable[[], bool] | None = None,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
        """Append token_ids to the session; logits of the last token [V] (or all [T, V]).

        The tokens run in stretches of `self.stretch` tokens, each one forward layer by layer:
        attention in micro-batches of `ubatch` tokens, the MoE ops over the whole stretch, so each
        expert is loaded once per stretch rather than once per micro-batch. The schedule depends
        only on the token counts, never on the cache, so results do not either. `should_stop`
        is asked before each micro-batch after the first: when it says yes, prefill stops and
        returns None; the session holds the stretches that were completed (a stretch left
        half-way leaves recurrent state and rings to be restored by `Session.truncate`, as after
        a failed forward). `progress(done, total)` hears of the tokens done as each layer of a
        stretch is (a stretch's tokens count in equal parts per layer)."""
        ubatch = _check_ubatch(ubatch)
        _check_callable("should_stop", should_stop)
        _check_callable("progress", progress)
        token_ids = self._id_list(token_ids, check_range=False)
        if not token_ids:
            raise ExpertCacheError("nothing to process: the prompt is empty")
        self._check_session(session)
        self._check_fits(session.kv.length + len(token_ids))
        self._check_range(min(token_ids), max(token_ids))
        if session.version != self.version:
            raise ExpertCacheError("the session was computed with weights that have since changed; "
                                   "start a new session")
        step = self.stretch
        # The whole prompt's keys and values at once: grown stretch by stretch, a long prompt's
        # cache was copied into a larger buffer at nearly every stretch (7 times for 32k tokens in
        # stretches of 4096), and a context that cannot fit fails here, before any work.
        session.kv.reserve(session.kv.length + len(token_ids))
        out = whole = None
        done = 0
        before = self._read_bytes()
        t0 = time.perf_counter()
        try:
            for s in range(0, len(token_ids), step):
                if s and should_stop is not None and should_stop():
                    return None
                part = token_ids[s: s + step]
                on_layer = None
                if progress is not None:
                    layers, n, total = len(self.net.weights.layers), len(part), len(token_ids)

                    def on_layer(i: int, s=s, n=n) -> None:
                        progress(s + n * (i + 1) // layers, total)
                try:
                    # Checked once above (`_id_list`): no second pass over each part.
                    ids = torch.tensor(part, dtype=torch.long).to(self.net.device)
                    out = self.net.forward(ids, session.kv, all_logits=all_logits, chunk=ubatch,
                                           should_stop=should_stop, on_layer=on_layer)
                except PrefillStopped:
                    return None
                if all_logits and len(token_ids) > step:
                    # Each stretch's logits into one [T, V] made at the first: joined at the end,
                    # the stretches' and the joined copy were held at once (twice [T, V]).
                    if whole is None:
                        whole = out.new_empty((len(token_ids), out.shape[-1]))
                    whole[s: s + len(part)] = out
                    out = None  # not held through the next stretch's forward
                session.tokens.extend(part)
                done += len(part)
        finally:
            self.last_prefill = PrefillStats(done, -(-done // step), self._read_bytes() - before,
                                             time.perf_counter() - t0)
            self.prefill_total = self.prefill_total + self.last_prefill
        if not all_logits:
            return out[-1]
        return out if whole is None else whole  # one stretch: its logits, not a copy

    def prefill_info(self) -> dict:
        """The prefill schedule and what the last prefill read, for JSON outputs."""
        return {"stretch": self.stretch, "stretch_activation_bytes": self.net.activation_bytes(self.stretch),
                "workspace_bytes": self.net.workspace.nbytes, "last": self.last_prefill.as_dict(),
                "total": self.prefill_total.as_dict()}

    def _read_bytes(self) -> int:
        return self.experts.telemetry_.copied_bytes()

    def _id_list(self, token_ids, check_range: bool = True) -> list[int]:
        """Token ids (a list or tuple of integers, a 1-D integer tensor or array) as a list of
        Python ints in the vocabulary (`check_range`); anything else is an ExpertCacheError naming it."""
        if torch.is_tensor(token_ids):
            token_ids = _one_sequence(token_ids).tolist()
        elif isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            # A string is iterable, and its characters would be refused one by one as "not integers".
            raise ExpertCacheError(f"token ids must be a list of integers, got {type(token_ids).__name__}"
                                   + (" (a text prompt goes to generate, or through tokenizer.encode)"
                                      if isinstance(token_ids, str) else ""))
        try:
            ids = [operator.index(t) for t in token_ids]
        except TypeError:
            raise ExpertCacheError(f"token ids must be integers, got {list(token_ids)[:8]}") from None
        if ids and check_range:
            self._check_range(min(ids), max(ids))
        return ids

    def _check_range(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = hi if hi >= self.cfg.vocab_size else lo
            raise ExpertCacheError(f"token id {bad} out of range: the vocabulary has {self.cfg.vocab_size} tokens")

    def _check_session(self, session) -> None:
        if not isinstance(session, Session):
            raise ExpertCacheError(f"session must be a Session (model.new_session()), got {type(session).__name__}")
        if session.owner is not None and session.owner is not self:
            raise ExpertCacheError("the session belongs to another model: start one with this model's new_session()")

    def _check_fits(self, n: int) -> None:
        if n > self.ctx_size:
            raise ExpertCacheError(f"{n} tokens do not fit the context of {self.ctx_size} tokens "
                                   "(raise -c/--ctx-size or shorten the prompt)")

    # ---- generation ----
    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: list[str] | None = None, ubatch: int = 512, session: Session | None = None,
                 on_text: Callable[[str], bool | None] | None = None,
                 ignore_eos: bool = False, should_stop: Callable[[], bool] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Generate after `prompt`. With `session`, its longest common prefix with the prompt is
        reused and the session holds the conversation afterwards (state computed with weights
        that have since changed is dropped, never reused). `on_text` receives each new piece of
        text; returning False stops generation. `should_stop` is asked between prefill
        micro-batches and before each generated token; a yes ends the call with finish reason
        `abort` (`processed_tokens`: the prompt tokens that ran). `progress(done, total)`
        follows the prompt tokens the call prefills (`prefill`)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
            raise ExpertCacheError(f"max_tokens {max_tokens!r} must be an integer >= 0")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ExpertCacheError(f"{self.path}: a text prompt needs a tokenizer, and this model has none "
                                   "(tokenizer.json is missing): pass token ids")
        # Everything is checked before the prompt runs: a stop string or callback of the wrong
        # type was otherwise a TypeError at the first generated token, after the whole prompt.
        if isinstance(stop, str):  # one stop string, not one per character
            stop = [stop]
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)):
            raise ExpertCacheError(f"stop {stop!r} must be a string or a list of strings")
        _check_ubatch(ubatch)
        for name, fn in (("on_text", on_text), ("should_stop", should_stop), ("progress", progress)):
            _check_callable(name, fn)
        if not isinstance(ignore_eos, bool):  # ignore_eos="no" would have been true
            raise ExpertCacheError(f"ignore_eos {ignore_eos!r} must be True or False")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._id_list(prompt, check_range=False)
        if not ids:
            raise ExpertCacheError("the prompt is empty")
        self._check_fits(len(ids))
        self._check_range(min(ids), max(ids))
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, min_p, seed))
        self.begin_call()
        if session is None:
            session = self.new_session()
        self._check_session(session)
        if session.version != self.version:
            # State of other weights: none of it is reused, and its buffers are made afresh, since
            # the new checkpoint may have other layers or shapes.
            session.kv, session.version = self.net.new_kv(self.ctx_size), self.version
            session.tokens.clear()
        cached = common_prefix(session.tokens, ids)
        cached = min(cached, len(ids) - 1)  # the last prompt token must run to give logits
        cached = session.truncate(cached)

        t0 = time.perf_counter()
        logits = self.prefill(session, ids[cached:], ubatch, should_stop=should_stop, progress=progress)
        t1 = time.perf_counter()
        if logits is None:  # stopped part-way: the stretches done are what ran
            return GenerationResult("", [], len(ids), cached, "abort", t1 - t0, 0.0, self.last_prefill.tokens)
        out: list[int] = []
        # The text continues the prompt: its last ids give the first piece its context (a
        # SentencePiece word's leading space).
        decoder = StreamDecoder(self.tokenizer, context=ids) if self.tokenizer else None
        text = ""
        sent = 0  # characters of `text` passed to on_text
        finish = "length"
        at_stop_string = False
        stop = [s for s in (stop or []) if s]
        while len(out) < max_tokens:
            # Asked at each token: on_text alone would not hear of a client that left while the
            # text is held back (a possible stop string) or no text came.
            if should_stop is not None and should_stop():
                finish = "abort"
                break
            tok = sampler(logits)
            if tok in self.eos_ids and not ignore_eos:
                finish = "stop"
                break
            out.append(tok)
            if decoder is not None:
                text += decoder.push(tok)
                hit = _find_stop(text, stop)
                if hit is not None:
                    text = text[:hit]
                    if on_text and hit > sent:
                        on_text(text[sent:])
                    finish, at_stop_string = "stop", True
                    break
                # Text that may be the start of a stop string is held back until the next
                # tokens show it is not: streamed text never holds part of a stop string.
                ready = len(text) - held_back(text, stop)
                if on_text and ready > sent:
                    piece, sent = text[sent:ready], ready
                    if on_text(piece) is False:
                        finish = "abort"
                        break
            if len(out) == max_tokens or session.kv.length >= self.ctx_size:
                break
            # A sampled token is in range by construction: no validation on the per-token path.
            step = torch.tensor([tok], dtype=torch.long, device=self.net.device)
            logits = self.net.forward(step, session.kv, all_logits=False)[-1]
            session.tokens.append(tok)
        t2 = time.perf_counter()
        if decoder is not None and not at_stop_string:
            # Flush what was held back: an incomplete UTF-8 tail, the start of a stop string.
            full = decoder.text()
            if on_text and full.startswith(text[:sent]) and len(full) > sent:
                on_text(full[sent:])
            text = full
        return GenerationResult(text, out, len(ids), cached, finish, t1 - t0, t2 - t1)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        if self.tokenizer is None:
            raise ExpertCacheError(f"{self.path}: chat needs a tokenizer, and this model has none (tokenizer.json is missing)")
        # A string would render as one message per character, and a list of strings (or of dicts
        # without a role) as messages without a role, all without a word.
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ExpertCacheError(f"messages must be a non-empty list of dicts, each with a 'role', such as "
                                   f"{{'role': 'user', 'content': 'hi'}}, got {messages!r:.80}")
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return self.generate(ids, **kwargs)


def _one_sequence(ids: torch.Tensor) -> torch.Tensor:
    """A tensor of token ids as one flat sequence: integers, shaped [T] or [1, T]. A float tensor
    would be truncated to ids and a batch read as one long sequence, both without a word."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ExpertCacheError(f"token ids must be integers, got a tensor of {ids.dtype}")
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ExpertCacheError(f"token ids must be one sequence, shaped [T] or [1, T], got a tensor of shape "
                               f"{list(ids.shape)}")
    return ids.reshape(-1)


def _check_ubatch(ubatch) -> int:
    if isinstance(ubatch, bool) or not isinstance(ubatch, numbers.Integral) or ubatch < 1:
        raise ExpertCacheError(f"ubatch {ubatch!r} must be an integer >= 1")
    return int(ubatch)


def _check_callable(name: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise ExpertCacheError(f"{name} {fn!r} must be a function or None")


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could still begin one of `stops` (0 if none):
    what `generate` holds back from `on_text` until the next tokens show it is not a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def default_model_path() -> Path:
    """The bundled model shipped inside the package."""
    return Path(__file__).parent / "assets" / "tiny-qwen3-moe"


def load(path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
         dtype: str | torch.dtype | None = None, cache: CacheConfig | None = None,
         ctx_size: int | None = None, threads: int | None = None, kernels: str = "auto",
         tokenizer: str | os.PathLike | None = None, prefill_stretch: int = 4096,
         prefill_mem: int | None = None, activations: str = "auto",
         rope_scaling: dict | RopeOverride | None = None) -> Model:
    """Load a Hugging Face MoE checkpoint directory or a GGUF file (the bundled model when `path`
    is None). `tokenizer` names a directory with a tokenizer.json to use instead of the model's.

    `threads` sets torch's CPU threads (None leaves them as they are). `kernels`: "auto" (native
    kernels for a bf16 model on the CPU where they build, torch's otherwise), "torch" or "native"
    (see `kernels`). `activations`: how products with quantized weights take their input: "q8"
    rounds it to 8 bits per block first, as llama.cpp's CPU products do, "exact" does not, "auto"
    is q8 where the native kernels run a quantized model (for products of up to 8 rows on a CPU
    with bf16 matrix instructions, all of them on one without) and exact elsewhere
    (`kernels.ACTIVATIONS_CHOICES`). `prefill_stretch`: tokens a long prompt's MoE ops run over per load of each
    expert (`Model.prefill`), cut to what `prefill_mem` bytes of activations hold (default
    2 GiB). `rope_scaling` sets the RoPE scaling over the checkpoint's own, as llama.cpp's
    --rope-scaling, --rope-scale and --yarn-orig-ctx do: a dict as config.json's rope_scaling
    (Qwen's model cards: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    32768}) with rope_type none, linear or yarn; what it leaves out is the model's own (a model
    without scaling scales linearly), and none turns a checkpoint's scaling off. Every argument is
    checked before a weight is read."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ExpertCacheError(f"threads {threads!r} must be an integer >= 1")
    if ctx_size is not None and (isinstance(ctx_size, bool) or not isinstance(ctx_size, int) or ctx_size < 1):
        raise ExpertCacheError(f"ctx-size {ctx_size!r} must be an integer >= 1")
    if cache is not None and not isinstance(cache, CacheConfig):
        raise ExpertCacheError(f"cache must be a CacheConfig, got {type(cache).__name__}")
    for name, value in (("prefill-stretch", prefill_stretch), ("prefill-mem", prefill_mem)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ExpertCacheError(f"{name} {value!r} must be an integer >= 1")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ExpertCacheError(f"model path {path!r} must be a string or a path (None: the bundled model)")
    if rope_scaling is not None and not isinstance(rope_scaling, RopeOverride):
        rope_scaling = RopeOverride.from_dict(rope_scaling)
    options = LoadOptions(_device(device), parse_dtype(dtype), cache or CacheConfig(), ctx_size, kernels,
                          prefill_stretch, prefill_mem or LoadOptions.prefill_mem, activations, rope_scaling)
    path = Path(path) if path is not None else default_model_path()
    # The tokenizer is read before the weights and the kernels (whose first build takes a
    # minute): a bad one fails at once.
    tok = Tokenizer(tokenizer) if tokenizer is not None else _tokenizer(path)
    if threads is not None:
        torch.set_num_threads(threads)
    cfg, net, experts = _assemble(path, options, None, None)
    model = Model(path, options, cfg, net, tok, experts)
    model.eos_ids |= _generation_eos(path, cfg.vocab_size)
    model._wire_prefetch()
    return model


def _unhook_prefetch(hooked: dict) -> None:
    """A dropped model's prefetch hooks let go of the decoder and the cache they tie together."""
    net, experts = hooked.pop("net", None), hooked.pop("experts", None)
    if net is not None:
        net.residual_hook = net.forward_hook = None
    if experts is not None:
        experts.predict = None


def _tokenizer(path: Path) -> Tokenizer | None:
    """The model's tokenizer: a GGUF file's metadata, or the checkpoint directory's
    tokenizer.json (None if it has none)."""
    from .gguf_tokenizer import tokenizer_parts_from_gguf
    from .models.gguf_loader import is_gguf

    if is_gguf(path):
        from .checkpoint.gguf_io import GGUFCheckpoint

        gg = GGUFCheckpoint(path)
        return Tokenizer.from_parts(*tokenizer_parts_from_gguf(gg.metadata, str(gg.files[0])))
    return Tokenizer(path) if (path / "tokenizer.json").exists() else None


def _generation_eos(path: Path, vocab_size: int) -> set[int]:
    """The ids generation_config.json ends generation at (`eos_token_id`, one or a list), as
    transformers' generate does: instruct checkpoints often name their end-of-turn token there
    alone (config.json holding only the end-of-text one)."""
    f = path / "generation_config.json"
    if not f.is_file():
        return set()
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExpertCacheError(f"{f}: not valid JSON: {e}") from None
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for t in eos:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ExpertCacheError(f"{f}: eos_token_id {t!r} is not a token id of the vocabulary of {vocab_size}")
    return set(eos)


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ExpertCacheError(f"unknown device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExpertCacheError(f"device {device!r} is not available: torch sees no CUDA device here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ExpertCacheError(f"device {device!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ExpertCacheError(f"device {device!r} is not supported: expected cpu, cuda or cuda:N")
    return dev


def _assemble(path: Path, options: LoadOptions, kernels: Kernels | None,
              experts: ExpertCache | None) -> tuple[ModelConfig, Decoder, ExpertCache]:
    """Open the checkpoint at `path` and build its decoder. A first load builds the kernels and
    the expert cache; a reload keeps them and hands the cache the new slow tier, which
    invalidates exactly the slots that went stale."""
    opened = open_model(path, options.rope)
    dtype = options.dtype or opened.cfg.dtype
    if kernels is None:  # before the weights: a bad choice costs nothing
        quantized = any(opened.experts.format(i).quantized for i in opened.cfg.moe_layers)
        kernels = select_kernels(options.kernels, options.device, dtype, quantized, options.activations)
    dense = load_dense(opened, options.device, dtype, kernels.multiplies_blocks, kernels.tiles)
    if experts is None:
        experts = build_experts(opened.experts, options.cache, options.device, dtype, kernels)
    else:
        experts.set_store(make_store_for(opened.experts, experts.config, options.device, dtype, kernels))
    net = Decoder(opened.cfg, dense, experts, kernels, options.device, dtype)
    return opened.cfg, net, experts
