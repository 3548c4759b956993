"""A fitted predictor of the next MoE layer's experts: one linear map per MoE layer (docs/cache.md,
"Prefetch").

The default predictor applies MoE layer l''s own router to an earlier residual. That residual
lacks what the layers in between add (for the first MoE layer, everything but the token's
embedding), and the router was trained on the later residual, so its ranking drifts: on the
bundled model it names under half of the first two layers' experts. A map fitted to exactly this
task, from the earlier residual (in l''s router-input normalisation) to l''s router logits, keeps
the cost of a router (one [D+1, E] product per token) and learns the average of what is missing.

`fit` runs the model over a text, accumulates each map's normal equations (ridge regression on
the logits, float64) and solves them once; the text's last tokens are held out to report each
layer's recall beside the router's. The maps are saved in a safetensors file that names the
model's routers by checksum, so that they are never applied to another model.

`fit_used` fits another kind of map (objective `used`): from the same input to one logit per
expert of the probability that the router picks it among its top-k, trained on that 0/1 target
(binary cross-entropy, AdamW), optionally through one hidden layer (GELU). Its probabilities are
calibrated, which the router's softmax is not: a guess of 0.6 is right about 60% of the time, so
`--prefetch-min-prob` can drop the guesses most likely wrong, which are most of the bytes a
prefetch wastes (docs/benchmarks.md, "A fitted predictor").

T = tokens, D = hidden, E = experts per layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ExpertCacheError
from .predict import RouterPredictor, embedded, next_moe_layers, rank_experts, router_input

FORMAT = "expertcache-predictor"
VERSION = 2
READS = ("1", "2")  # version 1: linear maps to the router logits only
OUTPUTS = ("logits", "used")  # what a map's scores are: router logits (softmax), or logits of use (sigmoid)


_CHECKSUMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its routers' checksum


def router_checksum(decoder, dtype: torch.dtype | None = None) -> str:
    """sha256 over the MoE layers' router weights, in layer order (what the maps were fitted to),
    as the decoder holds them (in `dtype` where given); once per decoder and dtype, whose weights
    do not change (a reload builds a new one)."""
    cached = _CHECKSUMS.setdefault(decoder, {})
    if dtype not in cached:
        digest = hashlib.sha256()
        for layer in decoder.cfg.moe_layers:
            r = decoder.weights.layers[layer].router.detach().to("cpu")
            r = r if dtype is None else r.to(dtype)
            digest.update(r.contiguous().view(torch.uint8).numpy().tobytes())
        cached[dtype] = digest.hexdigest()
    return cached[dtype]


# The compute dtypes a model can be loaded in (`--dtype`): the routers are held in it.
_ROUTER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def same_routers(decoder, checksum: str) -> bool:
    """Whether `checksum` (a file's `router_checksum`) names `decoder`'s routers, fitted with the
    model loaded in any compute dtype: a bf16 checkpoint's routers widened to fp32 (or fp16, where
    their values fit it) give back their own bytes when narrowed again, so the same routers match."""
    return any(router_checksum(decoder, dtype) == checksum for dtype in (None, *_ROUTER_DTYPES))


@dataclass
class LinearMaps:
    """Per MoE layer l: scores [T, E] = z @ weight[l].T + bias[l], with z = x (a linear map) or
    z = gelu(x @ hidden_weight[l].T + hidden_bias[l]) (one hidden layer), x the earlier residual in
    l's router-input normalisation (fp32). `output` says what the scores are: the router's logits
    (probabilities by softmax) or, per expert, the logit of its being used (by sigmoid)."""

    weight: dict[int, torch.Tensor]  # layer -> [E, D] (or [E, H] after a hidden layer) fp32
    bias: dict[int, torch.Tensor]  # layer -> [E] fp32
    routers: str  # router_checksum of the model fitted on
    meta: dict = field(default_factory=dict)  # how it was fitted (free-form, JSON)
    name: str = "linear"
    output: str = "logits"
    hidden_weight: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H, D] fp32, or empty
    hidden_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H] fp32

    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s scores [T, E] for the inputs x [T, D] (fp32, on the maps' device)."""
        if self.hidden_weight:
            x = torch.nn.functional.gelu(torch.addmm(self.hidden_bias[layer], x, self.hidden_weight[layer].T))
        return torch.addmm(self.bias[layer], x, self.weight[layer].T)  # [T, E]

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [T, E] as probabilities: softmax over the experts, or each expert's sigmoid."""
        return torch.sigmoid(scores) if self.output == "used" else torch.softmax(scores, dim=-1)

    def to(self, device) -> LinearMaps:
        def move(maps: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {k: v.to(device) for k, v in maps.items()}

        return LinearMaps(move(self.weight), move(self.bias), self.routers, self.meta, self.name, self.output,
                          move(self.hidden_weight), move(self.hidden_bias))

    def check(self, decoder) -> None:
        """A one-line error unless these maps were fitted on `decoder`'s model."""
        cfg = decoder.cfg
        if sorted(self.weight) != list(cfg.moe_layers):
            raise ExpertCacheError(f"predictor {self.name}: maps for MoE layers {sorted(self.weight)}, the model's "
                                   f"are {list(cfg.moe_layers)}")
        for layer, w in self.weight.items():
            hw = self.hidden_weight.get(layer)
            if hw is not None and tuple(hw.shape[1:]) != (cfg.hidden_size,):
                raise ExpertCacheError(f"predictor {self.name}: layer {layer} hidden map is {tuple(hw.shape)}, "
                                       f"expected (width, {cfg.hidden_size}) (its width, the model's hidden size)")
            inner = cfg.hidden_size if hw is None else hw.shape[0]
            if tuple(w.shape) != (cfg.num_experts, inner):
                raise ExpertCacheError(f"predictor {self.name}: layer {layer} map is {tuple(w.shape)}, expected "
                                       f"({cfg.num_experts}, {inner}) (experts, "
                                       f"{'hidden' if hw is None else 'its hidden layer'})")
        if not same_routers(decoder, self.routers):
            raise ExpertCacheError(f"predictor {self.name} was fitted on another model (its routers differ): "
                                   f"fit one for this model with `expertcache trace fit-predictor`")

    def save(self, path: str | os.PathLike) -> None:
        """Write the maps atomically: a failed write leaves no partial file and what was at `path`."""
        from safetensors.torch import save_file

        from ..checkpoint.writer import atomic_file

        path = Path(path)
        tensors = {}
        for kind, maps in (("weight", self.weight), ("bias", self.bias), ("hidden_weight", self.hidden_weight),
                           ("hidden_bias", self.hidden_bias)):
            tensors |= {f"{kind}.{layer}": t.contiguous() for layer, t in maps.items()}
        meta = {"format": FORMAT, "version": str(VERSION), "routers": self.routers, "fit": json.dumps(self.meta),
                "output": self.output}
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LinearMaps:
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        path = Path(path)
        if path.is_dir():
            raise ExpertCacheError(f"predictor {path}: a directory: expected a predictor file (.safetensors) that "
                                   "`expertcache trace fit-predictor` wrote")
        if not path.is_file():
            raise ExpertCacheError(f"predictor {path}: no such file (fit one with `expertcache trace fit-predictor`)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ExpertCacheError(f"predictor {path}: not a safetensors file ({e})") from None
        if meta.get("format") != FORMAT or meta.get("version") not in READS:
            raise ExpertCacheError(f"predictor {path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                                   f"expected {FORMAT!r} version {' or '.join(READS)}")
        output = meta.get("output", "logits")
        if output not in OUTPUTS:
            raise ExpertCacheError(f"predictor {path}: output {output!r}, expected one of {', '.join(OUTPUTS)}")
        got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in ("weight", "bias", "hidden_weight", "hidden_bias")}
        for key, t in tensors.items():
            kind, _, layer = key.partition(".")
            if kind not in got or not layer.isdigit():
                raise ExpertCacheError(f"predictor {path}: unexpected tensor {key!r}")
            got[kind][int(layer)] = t.float()
        weight, bias, hw, hb = got["weight"], got["bias"], got["hidden_weight"], got["hidden_bias"]
        if sorted(weight) != sorted(bias) or any(bias[k].shape != weight[k].shape[:1] for k in weight):
            raise ExpertCacheError(f"predictor {path}: each layer needs a weight [E, D] and a bias [E]")
        if hw and (sorted(hw) != sorted(weight) or sorted(hb) != sorted(weight)
                   or any(hb[k].shape != hw[k].shape[:1] or weight[k].shape[1:] != hw[k].shape[:1] for k in hw)):
            raise ExpertCacheError(f"predictor {path}: a hidden layer needs, for every layer, a hidden_weight [H, D] "
                                   f"and a hidden_bias [H], and a weight [E, H]")
        return cls(weight, bias, meta.get("routers", ""), json.loads(meta.get("fit", "{}")), name=path.name,
                   output=output, hidden_weight=hw, hidden_bias=hb)


FITTED = "linear:"  # a fitted predictor's name starts so (a trace's `predictor`): FITTED + the file's name


class LinearPredictor(RouterPredictor):
    """`RouterPredictor` with the fitted maps in place of the routers."""

    def __init__(self, decoder, width: int, maps: LinearMaps, scored: bool = True):
        super().__init__(decoder, width, scored)
        maps.check(decoder)
        self.name = FITTED + maps.name
        self.maps = maps.to(decoder.device)

    def rank(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = router_input(self.decoder, layer, h).float()  # [T, D]
        return self._ranked(self.maps.scores(layer, x), self.maps.probabilities)


def make_predictor(decoder, width: int, maps: LinearMaps | None = None, scored: bool = True) -> RouterPredictor:
    """The fitted predictor where maps are given, the router predictor otherwise (`scored`: with
    each guess's probability)."""
    return RouterPredictor(decoder, width, scored) if maps is None else LinearPredictor(decoder, width, maps, scored)


# ---- fitting -----------------------------------------------------------------------------------


class _Collector:
    """A residual hook that turns the residuals of a call's forwards into each MoE layer's
    (features, logits): features from the residual the predictor would see (the previous MoE
    layer's, or the embeddings for the first), logits from the layer's own router input. A call
    longer than the prefill stretch runs as several forwards, one per stretch: `take` joins them
    in order."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.next = next_moe_layers(decoder.cfg.moe_layers)
        self.features: dict[int, list[torch.Tensor]] = {}
        self.logits: dict[int, list[torch.Tensor]] = {}

    def begin(self, tokens: torch.Tensor) -> None:
        first = self.decoder.cfg.moe_layers[0]
        self.features.setdefault(first, []).append(
            router_input(self.decoder, first, embedded(self.decoder, tokens)).float())

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        lw = self.decoder.weights.layers[layer]
        if lw.router is None:
            return
        self.logits.setdefault(layer, []).append(router_input(self.decoder, layer, h).float() @ lw.router.float().T)
        nxt = self.next.get(layer)
        if nxt is not None:
            self.features.setdefault(nxt, []).append(router_input(self.decoder, nxt, h).float())  # [T, D]

    def take(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each MoE layer's (features [T, D], logits [T, E]) over the forwards since the last take."""
        out = {layer: (torch.cat(self.features[layer]), torch.cat(self.logits[layer]))
               for layer in self.decoder.cfg.moe_layers}
        self.features.clear()
        self.logits.clear()
        return out


def _with_one(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1).double()  # [T, D + 1]


def _recall(ranked: torch.Tensor, used: torch.Tensor) -> float:
    """Share of the used experts [T, K] that appear in the ranked ones [T, n]."""
    return float((ranked.unsqueeze(-1) == used.unsqueeze(1)).any(1).sum()) / used.numel()


MIN_FIT_TOKENS = 4096


def split_tokens(n: int, held_out: float = 0.1, ridge: float = 1.0) -> tuple[int, int]:
    """(tokens fitted on, tokens held out) of n; a one-line error for options that cannot fit."""
    if not 0 <= held_out < 1:
        raise ExpertCacheError(f"held-out share {held_out!r} must be in [0, 1)")
    if not ridge >= 0:
        raise ExpertCacheError(f"ridge {ridge!r} must be >= 0")
    n_eval = int(n * held_out)
    if n - n_eval < MIN_FIT_TOKENS:
        raise ExpertCacheError(f"{n - n_eval} tokens to fit on: give at least {MIN_FIT_TOKENS} "
                               f"(a longer text, or a larger -n)")
    return n - n_eval, n_eval


def _run_over(model, ids: list[int], n_fit: int, chunk: int, on_piece: Callable[[bool, int, torch.Tensor,
              torch.Tensor], None], progress: Callable[[int], None] | None) -> None:
    """Run `model` over `ids` in sequences of `chunk` tokens (each from an empty context; the fitted part
    and the held-out part apart) and hand each MoE layer's (features [T, D], router logits [T, E]),
    fp32 on the CPU, to `on_piece(fitted, layer, x, y)`."""
    net = model.net
    collect = _Collector(net)
    hooks = net.residual_hook, net.forward_hook
    net.residual_hook, net.forward_hook = collect, collect.begin
    try:
        for lo, hi in ((0, n_fit), (n_fit, len(ids))):
            for start in range(lo, hi, chunk):
                piece = ids[start:min(start + chunk, hi)]
                model.logits(piece)
                for layer, (features, logits) in collect.take().items():
                    on_piece(lo == 0, layer, features.cpu(), logits.cpu())
                if progress is not None:
                    progress(len(piece))
    finally:
        net.residual_hook, net.forward_hook = hooks


def _finish(model, maps: LinearMaps, held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
            report: dict) -> tuple[LinearMaps, dict]:
    """The report's `layers`: each layer's recall at width 1.0 on the held-out tokens, the router's
    beside the maps'; for maps of use, also recall and precision of the experts they give a
    probability of 0.5 or more. The maps' metadata then records how they were fitted."""
    K = model.cfg.top_k
    for layer, pieces in held.items():
        if not pieces:
            continue
        x = torch.cat([p[0] for p in pieces])
        used = rank_experts(torch.cat([p[1] for p in pieces]), K)
        by_router = rank_experts(x @ model.net.weights.layers[layer].router.float().cpu().T, K)
        scores = maps.scores(layer, x)
        row = {"router": round(_recall(by_router, used), 4), "linear": round(_recall(rank_experts(scores, K), used), 4)}
        if maps.output == "used":
            chosen = maps.probabilities(scores) >= 0.5  # [T, E]
            right = int(chosen.gather(1, used).sum())
            row |= {"recall_p50": round(right / used.numel(), 4),
                    "precision_p50": round(right / max(1, int(chosen.sum())), 4)}
        report["layers"][str(layer)] = row
    maps.meta = {"model": str(model.path), **{k: v for k, v in report.items() if k != "layers"},
                 "held_out_recall": report["layers"]}
    return maps, report


def fit(model, token_ids: Sequence[int], chunk: int = 1024, ridge: float = 1.0, held_out: float = 0.1,
        progress: Callable[[int], None] | None = None) -> tuple[LinearMaps, dict]:
    """Fit the maps on `model` run over `token_ids` (sequences of `chunk` tokens, each a fresh
    forward); the last `held_out` share of the tokens is kept out of the fit and measures each
    layer's recall at width 1.0, the router's beside the maps'. Returns (maps, report)."""
    ids = list(token_ids)
    n_fit, n_eval = split_tokens(len(ids), held_out, ridge)
    cfg = model.cfg
    moe, D = list(cfg.moe_layers), cfg.hidden_size
    gram = {layer: torch.zeros(D + 1, D + 1, dtype=torch.float64) for layer in moe}
    cross = {layer: torch.zeros(D + 1, cfg.num_experts, dtype=torch.float64) for layer in moe}
    held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in moe}

    def accumulate(fitted: bool, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if fitted:
            x1 = _with_one(x)
            gram[layer] += x1.T @ x1
            cross[layer] += x1.T @ y.double()
        else:
            held[layer].append((x, y))

    _run_over(model, ids, n_fit, chunk, accumulate, progress)
    weight, bias = {}, {}
    eye = torch.eye(D + 1, dtype=torch.float64)
    eye[D, D] = 0  # the bias is not shrunk
    for layer in moe:
        a = torch.linalg.solve(gram[layer] + ridge * eye, cross[layer]).float()  # [D + 1, E]
        weight[layer], bias[layer] = a[:D].T.contiguous(), a[D].contiguous()
    report = {"fit_tokens": n_fit, "held_out_tokens": n_eval, "ridge": ridge, "chunk": chunk, "layers": {}}
    maps = LinearMaps(weight, bias, router_checksum(model.net))
    return _finish(model, maps, held, report)


def fit_used(model, token_ids: Sequence[int], chunk: int = 1024, hidden: int = 512, epochs: int = 30,
             lr: float = 3e-3, batch: int = 4096, held_out: float = 0.1, seed: int = 0,
             progress: Callable[[int], None] | None = None,
             on_epoch: Callable[[int], None] | None = None) -> tuple[LinearMaps, dict]:
    """Fit maps of use (objective `used`, see the module): per MoE layer, from the predictor's input
    to one logit per expert of its being among the router's top-k, through one hidden layer of
    `hidden` units (GELU; 0: a linear map), trained with AdamW (one-cycle learning rate up to `lr`,
    `epochs` passes in batches of `batch` tokens, seeded by `seed`) on binary cross-entropy. The
    inputs are standardised for training; the standardisation is folded into the first map, so
    that the file holds plain affine maps. The held-out tokens report as `fit`'s do, plus recall
    and precision at probability 0.5. Returns (maps, report)."""
    ids = list(token_ids)
    n_fit, n_eval = split_tokens(len(ids), held_out)
    if not isinstance(hidden, int) or hidden < 0:
        raise ExpertCacheError(f"hidden width {hidden!r} must be an integer >= 0 (0: a linear map)")
    if not isinstance(epochs, int) or epochs < 1:
        raise ExpertCacheError(f"epochs {epochs!r} must be an integer >= 1")
    cfg = model.cfg
    moe, K = list(cfg.moe_layers), cfg.top_k
    need = n_fit * len(moe) * (cfg.hidden_size + K) * 2  # fp16 inputs and int16 expert ids, kept to train on
    free = _free_memory()
    if free is not None and need > 0.8 * free:
        raise ExpertCacheError(f"fitting maps of use on {n_fit:,} tokens keeps {need / 2**20:,.0f} MiB of inputs "
                               f"({len(moe)} MoE layers x {cfg.hidden_size} wide) and {free / 2**20:,.0f} MiB are "
                               f"free: give fewer tokens (-n)")
    feats: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe}
    used: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe}
    held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in moe}

    def keep(fitted: bool, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if fitted:  # half the memory: the features of a long text per layer
            feats[layer].append(x.half())
            used[layer].append(rank_experts(y, K).to(torch.int16))
        else:
            held[layer].append((x, y))

    _run_over(model, ids, n_fit, chunk, keep, progress)
    gen = torch.Generator().manual_seed(seed)
    weight, bias, hidden_weight, hidden_bias = {}, {}, {}, {}
    done = 0
    for layer in moe:
        x = torch.cat(feats.pop(layer)).float()  # [N, D]
        top = torch.cat(used.pop(layer)).long()  # [N, K]
        target = torch.zeros(len(x), cfg.num_experts).scatter_(1, top, 1.0)  # [N, E] 0/1
        w = _train_used(x.to(model.net.device), target.to(model.net.device), hidden, epochs, lr, batch, gen,
                        lambda: on_epoch and on_epoch(done))
        if hidden:
            hidden_weight[layer], hidden_bias[layer], weight[layer], bias[layer] = w
        else:
            weight[layer], bias[layer] = w
        done += 1
    report = {"fit_tokens": n_fit, "held_out_tokens": n_eval, "objective": "used", "hidden": hidden,
              "epochs": epochs, "lr": lr, "batch": batch, "seed": seed, "chunk": chunk, "layers": {}}
    maps = LinearMaps(weight, bias, router_checksum(model.net), output="used", hidden_weight=hidden_weight,
                      hidden_bias=hidden_bias)
    return _finish(model, maps, held, report)


def _free_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _train_used(x: torch.Tensor, target: torch.Tensor, hidden: int, epochs: int, lr: float, batch: int,
                gen: torch.Generator, on_epoch: Callable[[], None]) -> tuple[torch.Tensor, ...]:
    """One map of use from x [N, D] to the 0/1 target [N, E], trained on their device (the
    model's: a GPU trains it there): its tensors with the inputs' standardisation folded in
    ((hidden weight, hidden bias,) weight, bias; fp32, on the CPU)."""
    mu, sd = x.mean(0), x.std(0) + 1e-6  # [D]
    xn = (x - mu) / sd
    D, E = x.shape[1], target.shape[1]
    # The layers' initialisation (made on the CPU), seeded, the caller's RNG untouched: only the
    # CPU generator is reseeded (torch.manual_seed would reseed every GPU's too, beyond fork_rng).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        net = (torch.nn.Sequential(torch.nn.Linear(D, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, E))
               if hidden else torch.nn.Linear(D, E)).to(x.device)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * -(-len(x) // batch))
    with torch.enable_grad():
        for _ in range(epochs):
            for rows in torch.randperm(len(x), generator=gen).to(x.device).split(batch):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xn[rows]), target[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            on_epoch()
    first = net[0] if hidden else net
    with torch.no_grad():  # x -> (x - mu) / sd -> W x + b  ==  (W / sd) x + (b - (W / sd) mu)
        w = first.weight / sd
        b = first.bias - w @ mu
        out = (w, b) if not hidden else (w, b, net[2].weight.detach(), net[2].bias.detach())
        return tuple(t.to("cpu").contiguous() for t in out)
