#!/usr/bin/env python3
"""Train the bundled tiny Qwen3-MoE model from scratch on CPU.

Data: the Python standard library's own ``*.py`` sources (no test suites, no
site-packages, UTF-8 only). About 5% of the modules, chosen by the sha256 of
their relative path (``int(sha256(rel), 16) % 20 == 0``), are held out and
never trained on (nor used to fit the tokenizer).

The result is a real Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json, manifest.json)
written to ``src/expertcache/assets/tiny-qwen3-moe/`` by default, plus a
held-out text sample beside it, ``src/expertcache/assets/heldout.txt`` (with ``--out DIR``:
``DIR/../heldout.txt`` unless ``--heldout-out`` says otherwise).

Typical use (2 CPU cores)::

    nohup python tools/train_tiny_moe.py --threads 2 --minutes 43.5 \
        > runs/train.log 2>&1 &
    # interrupted / out of time?  continue from runs/tiny/ckpt.pt:
    python tools/train_tiny_moe.py --threads 2 --resume

The defaults (2000 steps of 8 x 512 tokens, warmup 100) are the schedule the
bundled model was trained with: about 40 minutes on 2 otherwise idle cores.

Needs the ``train`` extra (transformers).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"
DEFAULT_HELDOUT = REPO / "src" / "expertcache" / "assets" / "heldout.txt"
DEFAULT_WORK = REPO / "runs" / "tiny"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Path components that mark a test suite or third-party code.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
HELDOUT_MOD = 20


# --------------------------------------------------------------------------- data
def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest(), 16) % HELDOUT_MOD == 0


def scan_stdlib(root: Path) -> list[dict]:
    """All *.py files under `root` (sorted by relative path) with size, sha256, split."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if any(part in SKIP_DIRS for part in rel_dir.parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            rel = (rel_dir / name).as_posix()
            entries.append({
                "path": rel,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "split": "heldout" if is_heldout(rel) else "train",
            })
    entries.sort(key=lambda e: e["path"])
    return entries


def load_manifest(path: Path, root: Path | None = None) -> tuple[Path, list[dict]]:
    """Read a manifest and verify every file against its sha256 (under `root` where given: the
    same tree elsewhere, such as another machine's site-packages)."""
    man = json.loads(Path(path).read_text())
    root = Path(root or man["root"])
    if not root.is_dir() and man.get("corpus", "stdlib") == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
    bad = []
    for e in man["files"]:
        p = root / e["path"]
        if not p.is_file():
            bad.append(f"{e['path']}: missing")
            continue
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest != e["sha256"]:
            bad.append(f"{e['path']}: sha256 {digest[:12]}... != manifest {e['sha256'][:12]}...")
    if bad:
        shown = "\n  ".join(bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise SystemExit(
            f"error: {len(bad)} file(s) under {root} do not match manifest {path}:\n  {shown}{more}\n"
            "The standard library differs from the one the manifest was made from "
            "(another Python version?). Run without --manifest to build a new one."
        )
    return root, man["files"]


def read_text(root: Path, entry: dict) -> str:
    return (root / entry["path"]).read_bytes().decode("utf-8")


def write_heldout_sample(root: Path, entries: list[dict], path: Path, target_bytes: int) -> int:
    """Concatenate held-out files (sorted by path) until ~target_bytes; each followed by a blank line."""
    parts, total = [], 0
    for e in sorted((e for e in entries if e["split"] == "heldout"), key=lambda e: e["path"]):
        text = read_text(root, e).rstrip("\n") + "\n\n"
        n = len(text.encode("utf-8"))
        if total and total + n > target_bytes:
            continue  # skip files that would overshoot; keep looking for smaller ones
        parts.append(text)
        total += n
        if total >= target_bytes * 0.95:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts), encoding="utf-8")
    return total


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(tok) -> dict:
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# -------------------------------------------------------------------------- model
def model_config(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,  # unused (no dense MLP layers), kept sane
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        initializer_range=0.02,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=True,
        use_cache=True,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, total: int, warmup: int, peak: float, floor_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_for_step(step: int, n_blocks: int, batch: int, seed: int) -> list[int]:
    """Block indices for a step: epoch-wise seeded permutation, so any step is reproducible."""
    import torch

    per_epoch = n_blocks // batch
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    perm = torch.randperm(n_blocks, generator=g)
    return perm[i * batch:(i + 1) * batch].tolist()


def rng_state():
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(s):
    import numpy as np
    import torch

    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model output directory")
    ap.add_argument("--heldout-out", type=Path, default=None,
                    help="held-out text sample to write (default: heldout.txt beside --out, which for the "
                         "default --out is the bundled src/expertcache/assets/heldout.txt)")
    ap.add_argument("--heldout-bytes", type=int, default=350_000)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="work dir for checkpoints (ckpt.pt)")
    ap.add_argument("--manifest", type=Path, default=None, help="train from this manifest (files verified by sha256)")
    ap.add_argument("--resume", action="store_true", help="resume from WORK/ckpt.pt")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="train on the *.py files under this directory instead of the standard library "
                         "(for example a site-packages directory: other text, for a second model); with "
                         "--manifest, where the manifest's files are")
    ap.add_argument("--corpus-mb", type=float, default=None,
                    help="take files of --corpus in the order of the sha256 of their paths until this "
                         "many MB (a fixed, spread-out subset of a large tree)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000, help="total optimizer steps (the lr schedule length)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time budget for this invocation; on expiry a checkpoint is saved "
                         "(continue with --resume) and the model is exported as it is")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--aux-coef", type=float, default=0.001)
    ap.add_argument("--experts-impl", default="eager", help="transformers experts implementation (eager, grouped_mm, ...)")
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "none"],
                    help="CPU autocast for matmuls (master weights and optimizer stay fp32)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-mb", type=float, default=32.0)
    args = ap.parse_args(argv)
    # Beside the model it goes with: a model written elsewhere (a second corpus, an experiment)
    # replaced the bundled model's held-out text, which the GGUF fixtures' recordings are cut from.
    if args.heldout_out is None:
        args.heldout_out = args.out.parent / DEFAULT_HELDOUT.name
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.work / "ckpt.pt"

    # ---- data + manifest
    if args.manifest is not None:
        root, entries = load_manifest(args.manifest, args.corpus)
        print(f"manifest {args.manifest}: {len(entries)} files verified under {root}", flush=True)
    else:
        root = args.corpus.resolve() if args.corpus else Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise SystemExit(f"error: --corpus {root}: not a directory")
        entries = scan_stdlib(root)
        if args.corpus_mb:
            budget, kept = args.corpus_mb * 1e6, []
            for e in sorted(entries, key=lambda e: hashlib.sha256(e["path"].encode("utf-8")).hexdigest()):
                if budget <= 0:
                    break
                kept.append(e)
                budget -= e["size"]
            entries = sorted(kept, key=lambda e: e["path"])
    train_e = [e for e in entries if e["split"] == "train"]
    held_e = [e for e in entries if e["split"] == "heldout"]
    print(f"corpus {root}: {len(entries)} files, train {len(train_e)} "
          f"({sum(e['size'] for e in train_e)/1e6:.2f} MB), heldout {len(held_e)} "
          f"({sum(e['size'] for e in held_e)/1e6:.2f} MB)", flush=True)
    manifest = {
        "corpus": "stdlib" if root == Path(sysconfig.get_paths()["stdlib"]) else "directory",
        "root": str(root),
        "python": sys.version.split()[0],
        "heldout_rule": f"int(sha256(path), 16) % {HELDOUT_MOD} == 0",
        "skip_dirs": sorted(SKIP_DIRS),
        "files": entries,
    }

    # ---- tokenizer (train split only) + token stream
    train_texts = [read_text(root, e) for e in train_e]
    tok_path = args.work / "tokenizer.json"
    if args.resume and tok_path.exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
    else:
        t0 = time.time()
        tok = train_tokenizer(train_texts, args.vocab)
        tok.save(str(tok_path))
        print(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time()-t0:.1f}s", flush=True)
    eos_id = tok.token_to_id(EOS)
    encs = tok.encode_batch(train_texts, add_special_tokens=False)
    stream = []
    for enc in encs:
        stream.extend(enc.ids)
        stream.append(eos_id)
    stream = torch.tensor(stream, dtype=torch.int32)
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    L = args.seq_len
    n_blocks = (len(stream) - 1) // L
    if n_blocks < args.batch:
        raise SystemExit(f"error: the training split holds {n_blocks} sequences of --seq-len {L} tokens, fewer than "
                         f"--batch {args.batch}: expected a larger corpus (--corpus-mb) or a smaller batch")
    print(f"train tokens {len(stream):,} ({train_bytes/len(stream):.2f} bytes/token), "
          f"{n_blocks} blocks of {L}; {args.steps} steps x {args.batch} x {L} = "
          f"{args.steps*args.batch*L/len(stream):.2f} epochs", flush=True)

    # ---- model
    config = model_config(args, tok.get_vocab_size(), eos_id)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config)
    if args.experts_impl != "eager":
        model.set_experts_implementation(args.experts_impl) if hasattr(model, "set_experts_implementation") \
            else setattr(model.config, "_experts_implementation", args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    bytes_per = 2 if args.save_dtype == "bfloat16" else 4
    est_mb = n_params * bytes_per / 2**20
    print(f"model: {n_params/1e6:.2f}M params, ~{est_mb:.1f} MiB as {args.save_dtype}", flush=True)
    if est_mb > args.max_model_mb:
        raise SystemExit(f"error: model would be {est_mb:.1f} MiB > --max-model-mb {args.max_model_mb}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    step, tokens_seen, train_seconds = 0, 0, 0.0
    if args.resume:
        if not ckpt_path.exists():
            raise SystemExit(f"error: --resume but no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, tokens_seen, train_seconds = ck["step"], ck["tokens_seen"], ck["train_seconds"]
        set_rng_state(ck["rng"])
        print(f"resumed from {ckpt_path} at step {step}", flush=True)

    def save_ckpt():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "train_seconds": train_seconds, "rng": rng_state(),
                    "args": vars(args) | {"out": str(args.out), "work": str(args.work),
                                          "manifest": str(args.manifest), "heldout_out": str(args.heldout_out)}},
                   tmp)
        os.replace(tmp, ckpt_path)

    # ---- train
    model.train()
    t_start = time.time()
    last_ckpt = t_start
    deadline = t_start + args.minutes * 60 if args.minutes else None
    ema = None
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=False, ncols=110,
               mininterval=10.0, file=sys.stdout)
    losses = []
    while step < args.steps:
        if deadline and time.time() > deadline:
            print(f"\ntime budget of {args.minutes} min reached at step {step}", flush=True)
            break
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.tensor(batch_for_step(step, n_blocks, args.batch, args.seed))
        pos = idx[:, None] * L + torch.arange(L + 1)[None, :]
        seqs = stream[pos].long()
        x, y = seqs[:, :-1], seqs[:, 1:]
        t0 = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
        loss = ce + args.aux_coef * aux
        aux = aux.detach()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        dt = time.time() - t0
        train_seconds += dt
        step += 1
        tokens_seen += x.numel()
        ce_v = ce.item()
        losses.append(ce_v)
        ema = ce_v if ema is None else 0.95 * ema + 0.05 * ce_v
        bar.set_postfix_str(f"loss {ce_v:.3f} ema {ema:.3f} aux {float(aux):.3f} lr {lr:.1e} "
                            f"gn {float(gn):.2f} tok/s {x.numel()/dt:,.0f}", refresh=False)
        bar.update(1)
        if time.time() - last_ckpt > args.ckpt_every * 60:
            save_ckpt()
            last_ckpt = time.time()
    bar.close()
    save_ckpt()
    final = sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else float("nan")
    print(f"done: step {step}/{args.steps}, tokens {tokens_seen:,}, train time {train_seconds/60:.1f} min, "
          f"final loss (mean of last 20 steps) {final:.4f}", flush=True)

    # ---- export
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    save_dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    model.config.output_router_logits = False
    model.to(save_dtype)
    model.config.dtype = args.save_dtype
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None, do_sample=False, max_new_tokens=128)
    model.save_pretrained(out, safe_serialization=True)
    # Also spell the expert count and rope theta the way released Qwen3-MoE checkpoints do, so
    # loaders that read config.json directly (and older transformers) find them.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("num_experts", args.experts)
    cfg.setdefault("rope_theta", 10000.0)
    cfg["eos_token_id"] = eos_id
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Write our own minimal, explicit tokenizer_config.json (bos_token null, chat template inline).
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (out / extra).exists():
            (out / extra).unlink()
    manifest["training"] = {
        "steps": step, "total_steps": args.steps, "tokens_seen": tokens_seen,
        "train_minutes": round(train_seconds / 60, 2), "final_loss": round(final, 4),
        "seq_len": L, "batch": args.batch, "autocast": args.autocast, "warmup": args.warmup, "lr": args.lr, "seed": args.seed, "threads": args.threads,
        "train_tokens": len(stream), "train_bytes": train_bytes,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    n = write_heldout_sample(root, entries, args.heldout_out, args.heldout_bytes)
    print(f"wrote {out} ({dir_size(out)/2**20:.1f} MiB) and {args.heldout_out} ({n/1e3:.0f} KB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
