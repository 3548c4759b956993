"""Routing traces: what every MoE op of a run routed where, recorded, saved, loaded and summarised.

A trace holds, for each MoE op in execution order, the layer, the number of tokens, the phase
(prefill or decode) and each token's expert ids in router-rank order, plus a header describing the
model (expert count, layer count, top-k, bytes per expert). Since version 2 it may also hold, for
each op, the experts a predictor ranked for each of its tokens before its router ran
(`models/predict.py`); since version 3 also the probability the predictor gave each of those
experts (rounded to float16, as the runtime compares it with `--prefetch-min-prob`). On disk it
is one compressed `.npz` (see docs/traces.md, written so that traces recorded elsewhere can be
converted to it). Recording only reads the routing and the hidden state: the outputs of a run are
the same with and without it.

N = ops, R = routed token rows (the sum of the ops' token counts), K = top-k, P = experts
predicted per token (`pred_width`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ExpertCacheError

FORMAT = "expertcache-trace"
VERSION = 3
READS = (1, 2, 3)  # versions read; version 1 has no predictions, version 2 no probabilities
PHASES = ("prefill", "decode")  # the codes 0 and 1 of the `phase` array
ARRAYS = ("layer", "tokens", "phase", "ids")
PRED_ARRAYS = ("pred", "predicted")  # version 2
PROB_ARRAY = "pred_prob"  # version 3, optional


@dataclass(frozen=True, slots=True)
class TraceHeader:
    num_experts: int  # routed experts per MoE layer
    num_layers: int  # decoder layers, MoE or not
    moe_layers: tuple[int, ...]  # the layers that have routed experts, ascending
    top_k: int  # experts per token
    expert_bytes: int  # bytes of one expert (all its matrices) as the cache holds it
    model: str = ""  # where the trace came from: a path or a name
    meta: dict = field(default_factory=dict)  # how it was recorded (free-form, JSON)
    pred_width: int = 0  # experts ranked per token by the predictor (0: no predictions)
    predictor: str = ""  # which predictor ranked them

    @property
    def total_experts(self) -> int:
        return self.num_experts * len(self.moe_layers)

    def as_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "num_experts": self.num_experts,
                "num_layers": self.num_layers, "moe_layers": list(self.moe_layers), "top_k": self.top_k,
                "expert_bytes": self.expert_bytes, "model": self.model, "meta": self.meta,
                "pred_width": self.pred_width, "predictor": self.predictor}


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    layer: np.ndarray  # [N] layer of each op
    tokens: np.ndarray  # [N] tokens routed by each op
    phase: np.ndarray  # [N] 0 = prefill, 1 = decode
    ids: np.ndarray  # [R, K] expert ids of each token, router-rank order; op i owns the next tokens[i] rows
    pred: np.ndarray | None = None  # [R, P] predicted expert ids of each token, best first (P = pred_width)
    predicted: np.ndarray | None = None  # [N] 1 where op i has a prediction (its rows of `pred` hold it)
    pred_prob: np.ndarray | None = None  # [R, P] float16: the predictor's probability of each of `pred`

    @property
    def num_ops(self) -> int:
        return len(self.layer)

    @property
    def has_predictions(self) -> bool:
        return self.predicted is not None and bool(self.predicted.any())

    def predictions(self, width: float, min_prob: float = 0.0) -> list[list[int] | None]:
        """Each op's prediction at `width` (a multiple of top-k, as `--prefetch-width`) and
        `min_prob` (`--prefetch-min-prob`): the union of its tokens' ceil(width x K) best predicted
        experts (at most `pred_width`) whose probability is at least `min_prob`, by best rank then
        id; None for ops without one (and for every op at width 0)."""
        from ..models.predict import op_prediction, width_experts

        n = width_experts(width, self.header.top_k, self.header.pred_width)
        out: list[list[int] | None] = [None] * self.num_ops
        if n == 0 or not self.has_predictions:
            return out
        self.check_floor(min_prob)
        ends = np.cumsum(self.tokens)
        for i in np.flatnonzero(self.predicted):
            rows = slice(ends[i] - self.tokens[i], ends[i])
            probs = self.pred_prob[rows, :n].tolist() if min_prob > 0 else None
            out[i] = op_prediction(self.pred[rows, :n].tolist(), n, probs, min_prob) or None
        return out

    def check_floor(self, min_prob: float) -> None:
        """A one-line error unless the trace can be replayed at probability floor `min_prob`."""
        if min_prob > 0 and self.pred_prob is None:
            raise ExpertCacheError("--prefetch-min-prob needs a trace with the predictions' probabilities "
                                   "(format version 3, recorded by this expertcache's `trace record`)")

    def decode_tokens(self) -> int:
        """Tokens decoded: decode ops of the first MoE layer (one per generated token after the first)."""
        first = self.header.moe_layers[0]
        return int(self.tokens[(self.phase == 1) & (self.layer == first)].sum())

    def prefill_tokens(self) -> int:
        first = self.header.moe_layers[0]
        return int(self.tokens[(self.phase == 0) & (self.layer == first)].sum())

    def used(self) -> np.ndarray:
        """[N, E] bool: expert e used by op i."""
        op_of_row = np.repeat(np.arange(self.num_ops), self.tokens)  # [R]
        used = np.zeros((self.num_ops, self.header.num_experts), dtype=bool)
        used[op_of_row[:, None], self.ids] = True
        return used

    def ops(self) -> list[tuple[int, list[int]]]:
        """Each op as `(layer, sorted distinct expert ids)`: what the cache and the simulator see."""
        used = self.used()
        return [(int(layer), np.flatnonzero(row).tolist()) for layer, row in zip(self.layer, used)]


# ---- recording ---------------------------------------------------------------------------------


class TraceRecorder:
    """A routing hook that keeps each MoE op's expert ids (and, with `predict`, what the predictor
    ranked for it); `trace()` assembles the result.

    Ops are recorded as prefill; `generate` labels the ops of each call after it returns (the
    engine's own prefill/decode split, known from the tokens it reports as processed).
    """

    def __init__(self, header: TraceHeader, maps=None):
        self.header = header
        self.maps = maps  # fitted predictor maps (`models.linear_predictor`); None: the routers predict
        self._layers: list[int] = []
        self._ids: list = []  # torch tensors [T, K], kept on their device until `trace()`
        self._pred: list = []  # (ids [T, P], probabilities [T, P]) torch tensors, or None
        self._phase: list[int] = []
        self.predictor = None  # a `models.predict.RouterPredictor` while attached, if predicting

    @classmethod
    def for_model(cls, model, meta: dict | None = None, predict: bool = False) -> TraceRecorder:
        """A recorder for `model`; with `predict`, each op's prediction by the model's predictor
        (the next layer's router on the residual, the first MoE layer from the embeddings; or the
        fitted maps of `model.predictor_maps`), ranked 2 x top-k wide (so that widths up to 2.0
        can be evaluated)."""
        from ..models.linear_predictor import FITTED
        from ..models.predict import NextOpPredictions

        cfg = model.cfg
        # While recording, the runtime's prefetch reads the recorder's ranking: ranked narrower
        # than the prefetch width asks (--prefetch-width above 2), it would prefetch less than
        # without the recorder, and the trace could not replay the width that ran.
        runtime = model.experts.predict.n if isinstance(model.experts.predict, NextOpPredictions) else 0
        width = min(cfg.num_experts, max(2 * cfg.top_k, runtime)) if predict else 0
        maps = model.predictor_maps if predict else None
        name = ("router" if maps is None else FITTED + maps.name) if predict else ""
        return cls(TraceHeader(cfg.num_experts, cfg.num_layers, tuple(cfg.moe_layers), cfg.top_k,
                               max(model.experts.expert_bytes.values()), str(model.path), dict(meta or {}),
                               pred_width=width, predictor=name), maps)

    def __call__(self, layer: int, routing) -> None:
        # A copy, so that nothing the forward does later can change what was recorded; no host
        # synchronisation here (a GPU run is not slowed op by op).
        self._layers.append(layer)
        self._ids.append(routing.ids.detach().clone())
        self._pred.append(self.predictor.take(layer) if self.predictor is not None else None)
        self._phase.append(0)

    def __len__(self) -> int:
        return len(self._layers)

    @contextmanager
    def attached(self, model) -> Iterator[TraceRecorder]:
        """Record every MoE op `model` runs inside the block; the previous hooks come back after.

        With predictions, the predictor is the decoder's residual hook, and `forward` is wrapped
        on the decoder instance to hand each forward's tokens to the predictor first (the decoder
        has no hook that sees the tokens).
        """
        # A checkpoint rewritten on disk is reloaded at the start of the model's next call, onto a
        # new decoder that inherits the hooks but not the wrapped `forward`, and whose hooks
        # would outlive the block: reload it now, so that the hooks go on the decoder that runs.
        model.begin_call()
        net = model.net
        previous = net.routing_hook, net.residual_hook
        net.routing_hook = self
        if self.header.pred_width:
            from ..models.linear_predictor import make_predictor

            self.predictor = predictor = make_predictor(net, self.header.pred_width, self.maps)
            forward = net.forward

            def predicting_forward(tokens, *args, **kwargs):
                predictor.clear()
                predictor.predict_first(tokens)
                return forward(tokens, *args, **kwargs)

            net.residual_hook = predictor
            net.forward = predicting_forward
        try:
            yield self
        finally:
            net.routing_hook, net.residual_hook = previous
            if self.predictor is not None:
                del net.forward  # the class's method again
                self.predictor = None

    def generate(self, model, prompt, **kwargs):
        """`model.generate(prompt, **kwargs)` with this recorder attached; ops labelled by phase."""
        start = len(self)
        with self.attached(model):
            res = model.generate(prompt, **kwargs)
        # A prompt stopped part-way (`processed_tokens` set) decoded nothing: all its ops are
        # prefill, those of the stretch it left half-way too (they ran, past the tokens counted).
        self.label(start, None if res.processed_tokens is not None else res.prompt_processed)
        return res

    def label(self, start: int, prefill_tokens: int | None) -> None:
        """Ops from `start` on: the forwards that carried the first `prefill_tokens` tokens are
        prefill, later ones decode (None: all prefill). A forward begins at an op of the first MoE
        layer."""
        first = self.header.moe_layers[0]
        seen = 0
        phase = 0
        for i in range(start, len(self)):
            if self._layers[i] == first:
                phase = 0 if prefill_tokens is None or seen < prefill_tokens else 1
                seen += int(self._ids[i].shape[0])
            self._phase[i] = phase

    def trace(self) -> Trace:
        k, P = self.header.top_k, self.header.pred_width
        rows = [t.to("cpu").numpy().reshape(-1, k) for t in self._ids]
        ids = np.concatenate(rows) if rows else np.zeros((0, k), dtype=np.int64)
        dtype = _ids_dtype(self.header.num_experts)
        pred = np.zeros((len(ids), P), dtype=dtype)
        prob = np.zeros((len(ids), P), dtype=np.float16)
        predicted = np.zeros(len(rows), dtype=np.uint8)
        at = 0
        for i, (r, p) in enumerate(zip(rows, self._pred)):
            if p is not None:
                pred[at: at + len(r)] = p[0].to("cpu").numpy().reshape(len(r), P)
                prob[at: at + len(r)] = p[1].to("cpu").numpy().reshape(len(r), P)
                predicted[i] = 1
            at += len(r)
        return Trace(self.header, np.asarray(self._layers, dtype=np.int32),
                     np.asarray([len(r) for r in rows], dtype=np.int32),
                     np.asarray(self._phase, dtype=np.uint8), ids.astype(dtype), pred, predicted,
                     prob if P else None)


# More experts per layer than any MoE has, by far: the header's figure sizes tables of ops x experts.
MAX_EXPERTS = 1 << 20


def _ids_dtype(num_experts: int) -> type:
    return np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else np.int32


# ---- prompt files ------------------------------------------------------------------------------

PROMPT_KINDS = ("prompt", "user", "messages")


def parse_prompts(text: str, name: str) -> list[dict]:
    """A JSONL prompt file: one object per line, `{"prompt": str}`, `{"user": str}` or
    `{"messages": [{"role", "content"}, ...]}`, each with an optional `"max_tokens"`."""
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ExpertCacheError(f"{name}:{n}: not valid JSON ({e.msg})") from None
        kinds = [k for k in PROMPT_KINDS if isinstance(item, dict) and k in item]
        if len(kinds) != 1:
            raise ExpertCacheError(f"{name}:{n}: expected an object with exactly one of "
                                   f"{', '.join(repr(k) for k in PROMPT_KINDS)}")
        kind = kinds[0]
        value = item[kind]
        if kind == "messages":
            ok = isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)
        else:
            ok = isinstance(value, str) and value != ""
        if not ok:
            what = "a non-empty list of {role, content} strings" if kind == "messages" else "a non-empty string"
            raise ExpertCacheError(f"{name}:{n}: {kind!r} must be {what}")
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 0):
            raise ExpertCacheError(f"{name}:{n}: 'max_tokens' must be an integer >= 0, got {max_tokens!r}")
        items.append({"kind": kind, "value": value, "max_tokens": max_tokens})
    if not items:
        raise ExpertCacheError(f"{name}: no prompts (expected one JSON object per line)")
    return items


def run_prompts(model, recorder: TraceRecorder, items: Sequence[dict], max_tokens: int,
                on_result: Callable | None = None, **generate_kwargs) -> list:
    """Run the items of `parse_prompts` in turn on one session, recording.

    `prompt` is raw text; `messages` starts a new conversation; `user` appends a turn to the
    running conversation (after the previous reply). Every item generates a reply, which joins the
    conversation. The session keeps its KV state, so each item prefills only what differs from what
    the session already holds (the engine reuses the longest common prefix).
    """
    session = model.new_session()
    conversation: list[dict] = []
    results = []
    for item in items:
        if item["kind"] == "prompt":
            prompt = item["value"]
            conversation = []
        else:
            if item["kind"] == "messages":
                conversation = [dict(m) for m in item["value"]]
            else:
                conversation.append({"role": "user", "content": item["value"]})
            prompt = model.tokenizer.encode_chat(conversation)
        n = item["max_tokens"] if item["max_tokens"] is not None else max_tokens
        res = recorder.generate(model, prompt, max_tokens=n, session=session, **generate_kwargs)
        if item["kind"] != "prompt":
            conversation.append({"role": "assistant", "content": res.text})
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


# ---- files -------------------------------------------------------------------------------------


def save_trace(trace: Trace, path: str | Path, name: str | None = None) -> None:
    """Write `trace` as a compressed npz (the `.npz` suffix is not added: the path is used as given).
    `name`: the file errors name (default `path`): the output when `path` is a temporary file that
    becomes it, which the user never gave and would not look for."""
    name = str(path) if name is None else name
    _check(trace, name)
    header = json.dumps(trace.header.as_json())
    try:
        with open(path, "wb") as f:
            np.savez_compressed(f, header=np.array(header), layer=trace.layer.astype(np.int32),
                                tokens=trace.tokens.astype(np.int32), phase=trace.phase.astype(np.uint8),
                                ids=trace.ids, pred=_pred(trace), predicted=_predicted(trace),
                                **({PROB_ARRAY: trace.pred_prob} if trace.pred_prob is not None else {}))
    except OSError as e:
        raise ExpertCacheError(f"cannot write trace {name!r}: {e.strerror or e}") from None


# The first bytes of a zip archive (an npz file is one): a local file header, or the end record
# of an empty archive. Anything else is refused before numpy reads it, which would try it as a
# pickle and answer with a paragraph about allow_pickle.
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def load_trace(path: str | Path) -> Trace:
    """Read and validate a trace; any problem is one `ExpertCacheError` naming the file."""
    name = str(path)
    not_a_trace = f"{name}: not an expertcache trace: expected an .npz file written by `expertcache trace record`"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic not in _ZIP_MAGIC:
            raise ExpertCacheError(not_a_trace)
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("header", *ARRAYS) if k not in z.files]
            if missing:
                raise ExpertCacheError(f"{name}: not an expertcache trace: missing {', '.join(missing)}")
            raw = z["header"]
            arrays = {k: z[k] for k in ARRAYS + PRED_ARRAYS if k in z.files}
            prob = z[PROB_ARRAY] if PROB_ARRAY in z.files else None
        # numpy hands back the raw bytes of an entry that is not a .npy file.
        for k, a in {"header": raw, **arrays, PROB_ARRAY: prob}.items():
            if a is not None and not isinstance(a, np.ndarray):
                raise ExpertCacheError(f"{name}: not an expertcache trace: entry {k!r} is not a NumPy array")
    except ExpertCacheError:
        raise
    except FileNotFoundError:
        raise ExpertCacheError(f"cannot read trace {name!r}: no such file") from None
    except IsADirectoryError:
        raise ExpertCacheError(f"cannot read trace {name!r}: it is a directory") from None
    except OSError as e:
        if e.errno is not None:  # the file system's refusal (permissions, I/O), not the file's bytes
            raise ExpertCacheError(f"cannot read trace {name!r}: {e.strerror}") from None
        raise ExpertCacheError(f"{not_a_trace} ({_first_sentence(e)})") from None
    except Exception as e:
        # The file's bytes are at fault: numpy and zipfile answer a damaged archive with many
        # kinds of error (ValueError, EOFError, BadZipFile, zlib.error from a corrupt compressed
        # entry, tokenize and syntax errors from a mangled .npy header, MemoryError from a shape
        # no file could hold), and each must be one line naming the file, not a traceback.
        raise ExpertCacheError(f"{not_a_trace} ({_first_sentence(e)})") from None
    header, version = _parse_header(raw, name)
    if version < 3:
        prob = None  # not part of the format before version 3
    if version >= 2:
        missing = [k for k in PRED_ARRAYS if k not in arrays]
        if missing:
            raise ExpertCacheError(f"{name}: not an expertcache trace of version {version}: "
                                   f"missing {', '.join(missing)}")
    for k, a in arrays.items():
        if not np.issubdtype(a.dtype, np.integer):
            raise ExpertCacheError(f"{name}: array {k!r} must hold integers, got {a.dtype}")
    if prob is not None and prob.dtype != np.float16:
        raise ExpertCacheError(f"{name}: array {PROB_ARRAY!r} must hold float16, got {prob.dtype}")
    trace = Trace(header, arrays["layer"], arrays["tokens"], arrays["phase"], arrays["ids"],
                  arrays.get("pred"), arrays.get("predicted"), prob)
    _check(trace, name)
    return trace


def _first_sentence(e: Exception) -> str:
    """A library's error in a few words: its first sentence, or its type when it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(e).__name__


def _pred(trace: Trace) -> np.ndarray:
    if trace.pred is not None:
        return trace.pred
    return np.zeros((len(trace.ids), trace.header.pred_width), dtype=_ids_dtype(trace.header.num_experts))


def _predicted(trace: Trace) -> np.ndarray:
    return (trace.predicted if trace.predicted is not None else np.zeros(trace.num_ops)).astype(np.uint8)


def _parse_header(raw: np.ndarray, name: str) -> tuple[TraceHeader, int]:
    try:
        h = json.loads(str(raw[()]))
    except (json.JSONDecodeError, TypeError, IndexError, ValueError):
        raise ExpertCacheError(f"{name}: the trace header is not a JSON string") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise ExpertCacheError(f"{name}: not an expertcache trace (header format is not {FORMAT!r})")
    version = h.get("version")
    if version not in READS or isinstance(version, bool):
        raise ExpertCacheError(f"{name}: trace format version {version!r} is not supported "
                               f"(this expertcache reads versions {', '.join(map(str, READS))})")
    for k in ("num_experts", "num_layers", "top_k", "expert_bytes"):
        v = h.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "expert_bytes" else 1):
            raise ExpertCacheError(f"{name}: header {k!r} must be a positive integer, got {v!r}")
    layers = h.get("moe_layers")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
            or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= h["num_layers"]):
        raise ExpertCacheError(f"{name}: header 'moe_layers' must be distinct ascending layer indices "
                               f"below num_layers={h['num_layers']}, got {layers!r}")
    if h["num_experts"] > MAX_EXPERTS:  # tables of ops x experts are made from it
        raise ExpertCacheError(f"{name}: header 'num_experts' is {h['num_experts']}, more than the "
                               f"{MAX_EXPERTS} experts a layer of a trace may have")
    if h["top_k"] > h["num_experts"]:
        raise ExpertCacheError(f"{name}: header top_k={h['top_k']} exceeds num_experts={h['num_experts']}")
    meta = h.get("meta", {})
    width = h.get("pred_width", 0) if version >= 2 else 0
    if not isinstance(width, int) or isinstance(width, bool) or not 0 <= width <= h["num_experts"]:
        raise ExpertCacheError(f"{name}: header 'pred_width' must be an integer in [0, num_experts="
                               f"{h['num_experts']}], got {width!r}")
    return TraceHeader(h["num_experts"], h["num_layers"], tuple(layers), h["top_k"], h["expert_bytes"],
                       str(h.get("model", "")), meta if isinstance(meta, dict) else {}, width,
                       str(h.get("predictor", "")) if version >= 2 else ""), version


def _check(trace: Trace, name: str) -> None:
    h = trace.header
    if trace.layer.ndim != 1:  # its length is the op count every other array is checked against
        raise ExpertCacheError(f"{name}: array 'layer' has shape {trace.layer.shape}, expected (ops,)")
    n = trace.num_ops
    for k in ("layer", "tokens", "phase"):
        a = getattr(trace, k)
        if a.shape != (n,):
            raise ExpertCacheError(f"{name}: array {k!r} has shape {a.shape}, expected ({n},) like 'layer'")
    if trace.ids.ndim != 2 or trace.ids.shape[1] != h.top_k:
        raise ExpertCacheError(f"{name}: array 'ids' has shape {trace.ids.shape}, expected (rows, top_k={h.top_k})")
    if n == 0:
        raise ExpertCacheError(f"{name}: the trace has no ops")
    if trace.tokens.min() < 1:
        raise ExpertCacheError(f"{name}: op {int(np.argmin(trace.tokens))} routes "
                               f"{int(trace.tokens.min())} tokens, expected at least 1")
    if int(trace.tokens.sum()) != len(trace.ids):
        raise ExpertCacheError(f"{name}: the ops route {int(trace.tokens.sum())} tokens in all but 'ids' "
                               f"has {len(trace.ids)} rows")
    bad = ~np.isin(trace.layer, h.moe_layers)
    if bad.any():
        i = int(np.argmax(bad))
        raise ExpertCacheError(f"{name}: op {i} is on layer {int(trace.layer[i])}, which is not a MoE "
                               f"layer of the header ({list(h.moe_layers)})")
    bad = (trace.phase < 0) | (trace.phase >= len(PHASES))
    if bad.any():
        i = int(np.argmax(bad))
        raise ExpertCacheError(f"{name}: 'phase' must be 0 (prefill) or 1 (decode), got {int(trace.phase[i])} "
                               f"at op {i}")
    if trace.ids.size and (trace.ids.min() < 0 or trace.ids.max() >= h.num_experts):
        bad_id = int(trace.ids.max()) if trace.ids.max() >= h.num_experts else int(trace.ids.min())
        raise ExpertCacheError(f"{name}: expert id {bad_id} out of range: the header says "
                               f"{h.num_experts} experts per layer")
    if trace.pred is None and trace.predicted is None:
        return
    if trace.pred is None or trace.predicted is None:
        raise ExpertCacheError(f"{name}: 'pred' and 'predicted' go together: one of them is missing")
    if trace.pred.shape != (len(trace.ids), h.pred_width):
        raise ExpertCacheError(f"{name}: array 'pred' has shape {trace.pred.shape}, expected "
                               f"({len(trace.ids)}, pred_width={h.pred_width})")
    if trace.predicted.shape != (n,) or (n and trace.predicted.max() > 1) or (n and trace.predicted.min() < 0):
        raise ExpertCacheError(f"{name}: array 'predicted' must be {n} flags of 0 or 1")
    if trace.predicted.any() and h.pred_width == 0:
        raise ExpertCacheError(f"{name}: ops are marked predicted but the header's pred_width is 0")
    rows = np.repeat(trace.predicted.astype(bool), trace.tokens)  # [R]
    p = trace.pred[rows]
    if p.size and (p.min() < 0 or p.max() >= h.num_experts):
        bad_id = int(p.max()) if p.max() >= h.num_experts else int(p.min())
        raise ExpertCacheError(f"{name}: predicted expert id {bad_id} out of range: the header says "
                               f"{h.num_experts} experts per layer")
    if p.size and (np.sort(p, axis=1)[:, 1:] == np.sort(p, axis=1)[:, :-1]).any():
        raise ExpertCacheError(f"{name}: a token's predicted experts repeat an id (each row of 'pred' "
                               f"ranks distinct experts)")
    if trace.pred_prob is not None:
        if trace.pred_prob.shape != trace.pred.shape:
            raise ExpertCacheError(f"{name}: array {PROB_ARRAY!r} has shape {trace.pred_prob.shape}, expected "
                                   f"{trace.pred.shape} like 'pred'")
        q = trace.pred_prob[rows]
        if q.size and not (np.isfinite(q).all() and q.min() >= 0 and q.max() <= 1):
            raise ExpertCacheError(f"{name}: array {PROB_ARRAY!r} must hold probabilities in [0, 1]")


# ---- summaries ---------------------------------------------------------------------------------


def select(trace: Trace, phase: str | None) -> np.ndarray:
    """[N] bool: the ops of `phase` ('prefill', 'decode'; None: all)."""
    if phase is None:
        return np.ones(trace.num_ops, dtype=bool)
    return trace.phase == PHASES.index(phase)


def top_counts(num_experts: int) -> tuple[int, int]:
    """How many experts are the top 10% and the top 25% of a layer's `num_experts` (rounded up)."""
    return max(1, math.ceil(0.10 * num_experts)), max(1, math.ceil(0.25 * num_experts))


def popularity(trace: Trace, phase: str | None = None) -> dict[int, dict]:
    """Per layer, how skewed expert use is, counting one use per (op, distinct expert):
    the share of uses that go to the top 10% and 25% of experts, and the entropy of the use
    distribution in bits (log2(E) when uniform)."""
    used = trace.used()[select(trace, phase)]  # [n, E]
    layers = trace.layer[select(trace, phase)]
    E = trace.header.num_experts
    n10, n25 = top_counts(E)
    out = {}
    for layer in trace.header.moe_layers:
        counts = used[layers == layer].sum(axis=0)  # [E]
        total = int(counts.sum())
        if total == 0:
            continue
        ranked = np.sort(counts)[::-1]
        p = counts[counts > 0] / total
        out[layer] = {
            "uses": total,
            "top10_share": float(ranked[:n10].sum() / total),
            "top25_share": float(ranked[:n25].sum() / total),
            "entropy_bits": float(-(p * np.log2(p)).sum()),
            "max_entropy_bits": math.log2(E),
            "unused_experts": int((counts == 0).sum()),
        }
    return out


def reuse_distances(trace: Trace, phase: str | None = None) -> dict[int, np.ndarray]:
    """Per layer, for every use of an expert that was used before by an op of that layer: how many
    ops of that layer ago (1 = the previous op). Counted within the selected ops only."""
    used = trace.used()[select(trace, phase)]
    layers = trace.layer[select(trace, phase)]
    out = {}
    for layer in trace.header.moe_layers:
        u = used[layers == layer]  # [n, E]
        experts, ops = np.nonzero(u.T)  # by expert, then ascending op (row of `u`) within each
        same = experts[1:] == experts[:-1]
        out[layer] = (ops[1:] - ops[:-1])[same]
    return out


def reuse_summary(distances: np.ndarray, first_uses: int) -> dict:
    """Percentiles of reuse distances, and how many uses had none (first uses)."""
    if len(distances) == 0:
        return {"reuses": 0, "first_uses": first_uses}
    q = np.percentile(distances, [50, 75, 90, 99])
    return {"reuses": int(len(distances)), "first_uses": first_uses, "p50": float(q[0]), "p75": float(q[1]),
            "p90": float(q[2]), "p99": float(q[3]), "mean": float(distances.mean()),
            "share_le_1": float((distances <= 1).mean()), "share_le_4": float((distances <= 4).mean()),
            "share_le_16": float((distances <= 16).mean())}


WIDTHS = (1.0, 1.5, 2.0)  # prediction widths `trace stats` reports, as multiples of top-k


def quality_label(width: float, min_prob: float = 0.0) -> str:
    """How `prediction_quality` names a setting: "1.5", or "2.0,p>=0.55" with a probability floor."""
    return str(width) + (f",p>={min_prob:g}" if min_prob else "")


def prediction_quality(trace: Trace, phase: str | None = None, widths: Sequence[float] = WIDTHS,
                       floors: Sequence[tuple[float, float]] = ()) -> dict[int, dict]:
    """Per MoE layer, over the predicted ops of `phase`, at each width (a multiple of top-k) and
    each (width, probability floor) of `floors` (`--prefetch-min-prob`): recall (the share of the
    ops' distinct used experts that were predicted) and precision (the share of predicted experts
    that were used), both summed over ops before dividing. Layers with no predicted op are left
    out."""
    if not trace.has_predictions:
        return {}
    sel = select(trace, phase) & trace.predicted.astype(bool)
    used = trace.used()  # [N, E]
    out: dict[int, dict] = {}
    for width, min_prob in [(w, 0.0) for w in widths] + list(floors):
        hit = np.zeros_like(used)  # [N, E] predicted at this setting
        for i, p in enumerate(trace.predictions(width, min_prob)):
            if p is not None:
                hit[i, p] = True
        for layer in trace.header.moe_layers:
            ops = sel & (trace.layer == layer)
            if not ops.any():
                continue
            n_used, n_pred = int(used[ops].sum()), int(hit[ops].sum())
            correct = int((used[ops] & hit[ops]).sum())
            row = out.setdefault(layer, {"ops": int(ops.sum()), "used": n_used, "widths": {}})
            row["widths"][quality_label(width, min_prob)] = {
                "predicted": n_pred, "correct": correct, "recall": correct / n_used if n_used else 0.0,
                "precision": correct / n_pred if n_pred else 0.0}
    return out
