#!/usr/bin/env python3
"""Evaluate the bundled tiny Qwen3-MoE model on its held-out split.

Reports (and writes to ``<model>/report.json``):

* bits per byte on the held-out standard-library modules (total NLL in bits over the held-out
  tokens / held-out UTF-8 bytes; sliding windows of ``--window`` tokens, each token scored once
  with at least ``window - stride`` tokens of context where the file allows), against a unigram
  model (token frequencies of the training split, add-one smoothing) on the same tokens and the
  same byte denominator. Target: model <= 0.6 x unigram.
* def completion: one ``def ...:`` line (top-level or method) from each held-out file in path
  order, round robin, until ``--defs`` (20); prompt = the file up to and including the def line
  (left-truncated to ``--max-context`` tokens); greedy continuation of ``--gen-tokens`` tokens cut
  at its last complete line (and at the end of the function: the first non-blank line indented no
  deeper than the def); candidate = dedented def line + continuation; counted when ``ast.parse``
  accepts it. Target: at least half parse.
* routing skew per layer over the held-out tokens: share of routed assignments taken by the top
  25% of experts, max/min count ratio, normalized entropy of expert popularity.

Usage::

    python tools/eval_tiny_moe.py --threads 2
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"
EOS = "<|endoftext|>"
DEF_RE = re.compile(r"^( {0,4})(async\s+)?def\s+\w+\s*\(.*\)\s*(->\s*[^:]+)?:\s*(#.*)?$")


def load_split(model_dir: Path):
    man = json.loads((model_dir / "manifest.json").read_text())
    root = Path(man["root"])
    if not root.is_dir():
        root = Path(sysconfig.get_paths()["stdlib"])
    texts = {"train": [], "heldout": []}
    for e in man["files"]:
        data = (root / e["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            raise SystemExit(f"error: {root / e['path']} does not match manifest sha256 "
                             "(different Python standard library?)")
        texts[e["split"]].append((e["path"], data.decode("utf-8")))
    return man, texts


def bits_per_byte(model, tok, heldout, window, stride, unigram_logp, n_experts, top_k, batch=8):
    import torch

    eos = tok.token_to_id(EOS)
    nll_uni = 0.0
    n_tokens = 0
    n_bytes = 0
    # windows: (token ids of the window, first scored index in it); targets first..len-1
    jobs = []
    for path, text in heldout:
        n_bytes += len(text.encode("utf-8"))
        ids = [eos] + tok.encode(text, add_special_tokens=False).ids
        n_tokens += len(ids) - 1
        nll_uni += -sum(unigram_logp[i] for i in ids[1:])
        scored_upto, start = 1, 0  # position 0 (the EOS) is context only
        while scored_upto < len(ids):
            end = min(start + window, len(ids))
            jobs.append((ids[start:end], scored_upto - start))
            scored_upto = end
            start = end - (window - stride)
    # batch windows of equal length (all but the last of each file are full windows)
    by_len = {}
    for j in jobs:
        by_len.setdefault(len(j[0]), []).append(j)
    nll_model = 0.0
    counts = None
    for length in sorted(by_len):
        group = by_len[length]
        for b in range(0, len(group), batch):
            chunk = group[b:b + batch]
            x = torch.tensor([c[0] for c in chunk])
            with torch.no_grad():
                out = model(input_ids=x, output_router_logits=True, use_cache=False)
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            if counts is None:
                counts = [torch.zeros(n_experts, dtype=torch.long) for _ in out.router_logits]
            for r, (ids, first) in enumerate(chunk):
                tgt = x[r, first:]
                # logits at position p predict token p+1
                nll_model += -logp[r, first - 1:length - 1].gather(1, tgt[:, None]).sum().item()
            for layer, rl in enumerate(out.router_logits):
                rl = rl.reshape(len(chunk), length, n_experts)
                for r, (ids, first) in enumerate(chunk):
                    # routing of the inputs whose predictions were scored
                    top = torch.topk(torch.softmax(rl[r, first - 1:length - 1].float(), -1), top_k, dim=-1).indices
                    counts[layer] += torch.bincount(top.reshape(-1), minlength=n_experts)
    ln2 = math.log(2)
    return {
        "heldout_files": len(heldout),
        "heldout_bytes": n_bytes,
        "heldout_tokens": n_tokens,
        "model_bpb": nll_model / ln2 / n_bytes,
        "unigram_bpb": nll_uni / ln2 / n_bytes,
        "model_nats_per_token": nll_model / n_tokens,
        "unigram_nats_per_token": nll_uni / n_tokens,
    }, counts


def routing_skew(counts):
    layers = []
    for layer, c in enumerate(counts):
        c = c.double()
        total = c.sum().item()
        srt = sorted(c.tolist(), reverse=True)
        q = max(1, len(srt) // 4)
        p = c / total
        ent = -(p[p > 0] * p[p > 0].log()).sum().item() / math.log(len(srt))
        mn = min(srt)
        layers.append({
            "layer": layer,
            "assignments": int(total),
            "top25_share": sum(srt[:q]) / total,
            "max_min_ratio": (max(srt) / mn) if mn > 0 else None,
            "max_count": int(max(srt)),
            "min_count": int(mn),
            "unused_experts": sum(1 for v in srt if v == 0),
            "norm_entropy": ent,
        })
    return layers


def pick_defs(heldout, n):
    """One def line per file per round, files in path order, until n."""
    per_file = []
    for path, text in sorted(heldout):
        lines = text.split("\n")
        found = [i for i, line in enumerate(lines) if DEF_RE.match(line)]
        per_file.append((path, lines, found))
    picks, rnd = [], 0
    while len(picks) < n and any(rnd < len(f) for _, _, f in per_file):
        for path, lines, found in per_file:
            if rnd < len(found) and len(picks) < n:
                i = found[rnd]
                picks.append({"path": path, "line": i + 1, "def": lines[i],
                              "prefix": "\n".join(lines[:i + 1])})
        rnd += 1
    return picks


def cut_continuation(def_line: str, cont: str, ended: bool) -> list[str]:
    lines = cont.split("\n")
    if not ended:
        lines = lines[:-1]  # drop the incomplete last line
    # continuation starts right after the def line: first element is the rest of that line
    if lines and lines[0].strip() == "":
        lines = lines[1:]
    else:
        return []  # the model continued the def line itself; nothing sane to parse
    indent = len(def_line) - len(def_line.lstrip())
    body = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the function has ended
        body.append(line)
    while body and not body[-1].strip():
        body.pop()
    return body


def def_completion(model, tok, heldout, n, max_context, gen_tokens):
    import torch

    eos = tok.token_to_id(EOS)
    results = []
    for p in pick_defs(heldout, n):
        ids = [eos] + tok.encode(p["prefix"], add_special_tokens=False).ids
        ids = ids[-max_context:]
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
        new = out[0, len(ids):].tolist()
        ended = eos in new
        if ended:
            new = new[:new.index(eos)]
        cont = tok.decode(new, skip_special_tokens=False)
        body = cut_continuation(p["def"], cont, ended)
        candidate = textwrap.dedent("\n".join([p["def"]] + body)) + "\n"
        try:
            ast.parse(candidate)
            ok = True
            err = None
        except SyntaxError as e:
            ok = False
            err = f"{e.msg} (line {e.lineno})"
        results.append({"path": p["path"], "line": p["line"], "def": p["def"].strip(),
                        "body_lines": len(body), "parses": ok, "error": err,
                        "candidate": candidate, "continuation": cont, "ended_with_eos": ended})
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--report", type=Path, default=None, help="default: MODEL/report.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="windows per forward pass")
    ap.add_argument("--defs", type=int, default=20)
    ap.add_argument("--max-context", type=int, default=384,
                    help="prompt tokens kept (left-truncated); prompt + generation stays within the "
                         "512-token training length")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--max-files", type=int, default=None, help="debug: only this many held-out files")
    args = ap.parse_args(argv)
    # Each window scores the tokens after its first window - stride: with stride >= window none
    # are, and the scoring slices went empty (a RuntimeError from gather).
    if not 0 < args.stride < args.window:
        ap.error(f"--stride {args.stride} with --window {args.window}: expected 0 < stride < window")
    if not (args.model / "manifest.json").is_file():
        ap.error(f"--model {str(args.model)!r} has no manifest.json: expected a model written by "
                 "tools/train_tiny_moe.py (its manifest names the held-out files)")

    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    man, texts = load_split(args.model)
    heldout = sorted(texts["heldout"])
    if args.max_files:
        heldout = heldout[:args.max_files]
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    V = tok.get_vocab_size()

    # unigram on the training split, add-one smoothing
    counts = [1] * V
    eos = tok.token_to_id(EOS)
    for enc in tok.encode_batch([t for _, t in texts["train"]], add_special_tokens=False):
        for i in enc.ids:
            counts[i] += 1
        counts[eos] += 1  # the document separator, as in training
    total = sum(counts)
    unigram_logp = [math.log(c / total) for c in counts]

    model = Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    cfg = model.config
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts

    # sanity: the HF tokenizer loads, has no BOS, and renders the chat template
    hf_tok = PreTrainedTokenizerFast.from_pretrained(args.model)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(chat)
    assert hf_tok.bos_token is None and hf_tok.eos_token == EOS

    t1 = time.time()
    bpb, route_counts = bits_per_byte(model, tok, heldout, args.window, args.stride, unigram_logp,
                                      n_experts, cfg.num_experts_per_tok, args.batch)
    bpb["ratio"] = bpb["model_bpb"] / bpb["unigram_bpb"]
    bpb["target_ratio"] = 0.6
    bpb["meets_target"] = bpb["ratio"] <= 0.6
    bpb["window"], bpb["stride"] = args.window, args.stride
    t2 = time.time()
    skew = routing_skew(route_counts)
    defs = def_completion(model, tok, heldout, args.defs, args.max_context, args.gen_tokens)
    t3 = time.time()
    n_ok = sum(r["parses"] for r in defs)

    report = {
        "model": {
            "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "num_experts": n_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "parameters": sum(p.numel() for p in model.parameters()),
            "safetensors_bytes": (args.model / "model.safetensors").stat().st_size,
        },
        "training": man.get("training"),
        "bits_per_byte": bpb,
        "def_completion": {"parsed": n_ok, "total": len(defs), "target": (len(defs) + 1) // 2,
                           "meets_target": n_ok >= (len(defs) + 1) // 2,
                           "max_context": args.max_context, "gen_tokens": args.gen_tokens,
                           "results": defs},
        "routing_skew": skew,
        "eval_seconds": {"bpb": round(t2 - t1, 1), "defs": round(t3 - t2, 1), "total": round(t3 - t0, 1)},
        "torch_threads": args.threads,
    }
    out = args.report or (args.model / "report.json")
    out.write_text(json.dumps(report, indent=1) + "\n")

    print(f"held-out: {bpb['heldout_files']} files, {bpb['heldout_bytes']:,} bytes, "
          f"{bpb['heldout_tokens']:,} tokens")
    print(f"{'':24}{'bits/byte':>10}{'nats/token':>12}")
    print(f"{'model':24}{bpb['model_bpb']:>10.4f}{bpb['model_nats_per_token']:>12.4f}")
    print(f"{'unigram (add-one)':24}{bpb['unigram_bpb']:>10.4f}{bpb['unigram_nats_per_token']:>12.4f}")
    print(f"ratio model/unigram = {bpb['ratio']:.3f} (target <= 0.6: "
          f"{'PASS' if bpb['meets_target'] else 'FAIL'})")
    print(f"def completion: {n_ok}/{len(defs)} parse (target >= {(len(defs) + 1) // 2}: "
          f"{'PASS' if report['def_completion']['meets_target'] else 'FAIL'})")
    for r in defs:
        print(f"  {'ok ' if r['parses'] else 'BAD'} {r['path']}:{r['line']} {r['def'][:60]}"
              f"  [{r['body_lines']} lines]{'' if r['parses'] else '  ' + r['error']}")
    print("routing skew over held-out tokens:")
    print(f"{'layer':>6}{'top25% share':>14}{'max/min':>10}{'norm. entropy':>15}{'unused':>8}")
    for s in skew:
        mm = f"{s['max_min_ratio']:.2f}" if s["max_min_ratio"] is not None else "inf"
        print(f"{s['layer']:>6}{s['top25_share']:>14.3f}{mm:>10}{s['norm_entropy']:>15.3f}{s['unused_experts']:>8}")
    print(f"wrote {out} in {t3 - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
