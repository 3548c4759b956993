"""Learned predictors beside the committed linear maps (docs/benchmarks.md, "A fitted predictor"):
how much recall at width 1.0 a larger fit, more inputs or a nonlinear map would add on the bundled
model. Each variant maps what the predictor of MoE layer l sees (the earlier residual in l's
router-input normalisation, as `trace fit-predictor` uses) to l's router logits:

- `ridge`: the committed method (ridge regression on the logits), on the first 59,000 tokens (as
  many as the committed maps were fitted on) and on all of them;
- `ridge+prev`: with the previous MoE layer's router probabilities for the same token as inputs too
  (known at the same point: that router runs on the same residual);
- `linear kl` / `mlp kl`: a linear map / one hidden layer of 512 (GELU), trained with AdamW on the
  KL divergence from the router's distribution, 30 epochs over 300,000 tokens.

Fitted on the standard library's top-level modules less the model's held-out ones, scored on
`src/expertcache/assets/heldout.txt` (the model's held-out text). About 7 minutes on 2 cores
and 3 GB of memory. Run from the repository root: `python docs/traces/predictor_variants.py`.
"""

from __future__ import annotations

import glob
import json
import sysconfig

import numpy as np
import torch

from expertcache.engine import load
from expertcache.models.linear_predictor import _Collector
from expertcache.models.predict import rank_experts

HELDOUT = "src/expertcache/assets/heldout.txt"


def stdlib_text(held: str) -> str:
    """The top-level standard-library modules whose opening is not in the held-out text."""
    out = []
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
        with open(path, errors="replace") as f:
            text = f.read()
        if text[:300] not in held:
            out.append(text)
    return "".join(out)


def collect(model, ids: list[int], chunk: int = 1024) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer: (predictor inputs [T, D] fp16, router logits [T, E] fp32) over `ids`."""
    net = model.net
    got = {layer: ([], []) for layer in net.cfg.moe_layers}
    c = _Collector(net)
    hooks = net.residual_hook, net.forward_hook
    net.residual_hook, net.forward_hook = c, c.begin
    try:
        for s in range(0, len(ids), chunk):
            model.logits(ids[s:s + chunk])
            for layer, (features, logits) in c.take().items():
                got[layer][0].append(features.half())
                got[layer][1].append(logits)
    finally:
        net.residual_hook, net.forward_hook = hooks
    return {layer: (torch.cat(x), torch.cat(y)) for layer, (x, y) in got.items()}


def recall(pred: torch.Tensor, y: torch.Tensor, k: int) -> float:
    used, got = rank_experts(y, k), rank_experts(pred, k)
    return float((got.unsqueeze(-1) == used.unsqueeze(1)).any(1).sum()) / used.numel()


def ridge(x: torch.Tensor, y: torch.Tensor, lam: float = 1.0):
    x1 = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    a = torch.linalg.solve(x1.T @ x1 + lam * torch.eye(x1.shape[1], dtype=torch.float64), x1.T @ y.double()).float()
    return lambda z: torch.cat([z, torch.ones(len(z), 1)], 1) @ a


def trained(x: torch.Tensor, y: torch.Tensor, hidden: int, epochs: int = 30, lr: float = 3e-3, batch: int = 4096):
    mu, sd = x.mean(0), x.std(0) + 1e-6
    d, e = x.shape[1], y.shape[1]
    net = (torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, e))
           if hidden else torch.nn.Linear(d, e))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * -(-len(x) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)
    xn, target = (x - mu) / sd, torch.log_softmax(y, -1)
    for _ in range(epochs):
        for j in torch.randperm(len(x)).split(batch):
            loss = torch.nn.functional.kl_div(torch.log_softmax(net(xn[j]), -1), target[j], log_target=True,
                                              reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    net.eval()
    return lambda z: net((z - mu) / sd).detach()


def main() -> None:
    torch.manual_seed(0)
    model = load(None, kernels="torch")
    moe, k = list(model.cfg.moe_layers), model.cfg.top_k
    with open(HELDOUT) as f:
        held = f.read()
    fit = collect(model, model.tokenizer.encode(stdlib_text(held))[:700_000])
    ev = collect(model, model.tokenizer.encode(held))

    def inputs(data, layer, prev):
        x = data[layer][0].float()
        if prev and layer != moe[0]:
            x = torch.cat([x, 10 * torch.softmax(data[moe[moe.index(layer) - 1]][1], -1)], 1)
        return x

    variants = {"ridge, 59k tokens": (lambda x, y: ridge(x[:59_000], y[:59_000]), False),
                "ridge": (ridge, False),
                "ridge+prev": (ridge, True),
                "linear kl, 300k": (lambda x, y: trained(x[:300_000], y[:300_000], 0), False),
                "mlp kl, 300k": (lambda x, y: trained(x[:300_000], y[:300_000], 512), False)}
    print(f"fitted on {len(fit[moe[0]][0]):,} tokens, scored on {len(ev[moe[0]][0]):,}; recall at width 1.0")
    print(f"{'variant':<20}" + "".join(f"{'layer ' + str(layer):>9}" for layer in moe) + f"{'mean':>7}")
    result = {}
    for name, (make, prev) in variants.items():
        row = [recall(make(inputs(fit, layer, prev), fit[layer][1])(inputs(ev, layer, prev)), ev[layer][1], k)
               for layer in moe]
        result[name] = [round(r, 4) for r in row]
        print(f"{name:<20}" + "".join(f"{r:>9.3f}" for r in row) + f"{np.mean(row):>7.3f}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
