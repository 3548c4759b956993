"""Build the small GGUF test fixtures under tests/fixtures/gguf/ and record llama.cpp's outputs
on them; or, run again, check the recordings against llama.cpp.

    pip install llama-cpp-python gguf transformers safetensors sentencepiece   # in its own venv
    python tools/make_gguf_fixtures.py --llama-cpp DIR              # check the committed recordings
    python tools/make_gguf_fixtures.py --llama-cpp DIR --rebuild    # build everything again
    python tools/make_gguf_fixtures.py --llama-cpp DIR --rebuild --family qwen3_5_moe  # one family
    python tools/make_gguf_fixtures.py --llama-cpp DIR --bundled OUTDIR

DIR is a llama.cpp source tree (the one vendored in llama-cpp-python's source distribution,
vendor/llama.cpp, matches the library): its convert_hf_to_gguf.py does the conversion. It is only
needed with --rebuild and --bundled; the default (environment variable LLAMA_CPP_DIR) is used when
the flag is absent.

--rebuild, for each family in gguf_fixture_models.FAMILIES: builds a tiny random transformers
checkpoint (seeded, bf16, the bundled model's byte-level BPE tokenizer) in WORK/hf/<family>,
converts it to F32 with convert_hf_to_gguf.py (naming the pre-tokenizer 'gpt-2' for it), quantizes
it with llama_model_quantize to every type in QUANTS, and records llama.cpp's outputs for every
file in WORK (--family: only those families, the others' committed files left as they are).
The files listed in COMMITTED (the smallest set whose tensors cover all of
REQUIRED_TYPES, a few MB) are copied with their recordings to --out. Each recording
(<name>.json and <name>.npz, see docs/gguf.md) holds llama.cpp's token ids for a held-out slice of
src/expertcache/assets/heldout.txt, its fp32 logits at every position of PROMPT, and its
perplexity on the slice at n_ctx = PPL_CTX, computed as llama-perplexity does (llamacpp_ref).

Without --rebuild, every recording in --out is recomputed with llama.cpp from the committed GGUF and
compared: token ids exactly, logits and per-chunk NLL to LOGIT_TOL / PPL_TOL; mismatches are
printed and the exit code is 1.

--bundled OUTDIR converts the bundled model (src/expertcache/assets/tiny-qwen3-moe) to F32 and BF16,
quantizes it to Q8_0 and Q4_K_M, and writes OUTDIR/bundled_ppl.json: llama.cpp's perplexity of each
on all of heldout.txt at n_ctx 512.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

import llamacpp_ref as ref  # exits with a one-line message when llama-cpp-python is missing
from gguf_fixture_models import FAMILIES, build_checkpoint, tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "expertcache" / "assets"
BUNDLED = ASSETS / "tiny-qwen3-moe"
HELDOUT = ASSETS / "heldout.txt"
HELDOUT_CHARS = (0, 2000)  # the slice of heldout.txt the fixtures are scored on (~520 tokens)
PPL_CTX = 128              # 4 chunks of the slice
PROMPT = "The cache keeps experts resident between forwards."
LOGIT_TOL = 1e-4           # relative to the largest |logit|; the same build gives equal bits
PPL_TOL = 1e-6             # relative, per chunk NLL

REQUIRED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                  "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
QUANTS = {  # family -> llama-quantize types made of it
    "qwen3_moe": ("Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K_M"),
    "qwen2_moe": ("Q8_0", "Q4_K_M"), "olmoe": ("Q8_0", "Q4_K_M"), "mixtral": ("Q8_0", "Q4_K_M"),
    "qwen3_5_moe": ("Q8_0",),
    "gemma4": ("Q8_0", "Q4_K_M"), "gemma4_v": (),
}
# Converter flags per family: the Qwen3.5 converter wants the MTP head, which a text-only
# checkpoint does not have, unless told to drop it.
CONVERT_ARGS = {"qwen3_5_moe": ("--no-mtp",)}
# One qwen3_moe file in which every tensor class carries a different type (llama-quantize
# --tensor-type), so that one 2-layer model holds all of REQUIRED_TYPES: a Q4_K_M mix with
# K-quant experts, the 32-element-block types on attention, F16/BF16 on layer 1's attention.
MIX = {  # llama.cpp takes the first pattern that matches (std::regex_search), hence the anchors
    r"^token_embd\.weight$": "IQ4_XS", r"^output\.weight$": "Q5_K",
    r"^blk\.0\.ffn_(gate|up)_exps\.weight$": "Q4_K", r"^blk\.0\.ffn_down_exps\.weight$": "Q6_K",
    r"^blk\.1\.ffn_(gate|up)_exps\.weight$": "Q2_K", r"^blk\.1\.ffn_down_exps\.weight$": "Q3_K",
    r"^blk\.0\.attn_q\.weight$": "Q8_0", r"^blk\.0\.attn_k\.weight$": "Q4_0",
    r"^blk\.0\.attn_v\.weight$": "Q5_0", r"^blk\.0\.attn_output\.weight$": "IQ4_NL",
    r"^blk\.1\.attn_q\.weight$": "Q4_1", r"^blk\.1\.attn_k\.weight$": "Q5_1",
    r"^blk\.1\.attn_v\.weight$": "F16", r"^blk\.1\.attn_output\.weight$": "BF16",
}
# Marks a --work folder as made by --rebuild: only such a folder is emptied by the next one.
WORK_MARKER = ".make_gguf_fixtures-work"
# Qwen3.5's files live in their own folder: its F32 file is there for the exact comparison, and
# the type-coverage set above stays as it was.
COMMITTED = ("qwen3_moe-mix", "qwen2_moe-Q4_K_M", "olmoe-Q8_0", "mixtral-Q8_0", "qwen3_5_moe/qwen3_5_moe-F32",
             "qwen3_5_moe/qwen3_5_moe-Q8_0", "gemma4/gemma4-F32", "gemma4/gemma4-Q8_0", "gemma4/gemma4_v-F32")


def convert(llama_dir: Path, family: str, hf_dir: Path, out: Path) -> Path:
    """`llamacpp_ref.convert` to F32, with the family's converter flags (CONVERT_ARGS)."""
    import subprocess

    if not CONVERT_ARGS.get(family):
        return ref.convert(llama_dir, hf_dir, out, "f32")
    cmd = [sys.executable, "-c", ref._CONVERT_BOOTSTRAP, str(llama_dir), "gpt-2", str(hf_dir),
           "--outtype", "f32", "--outfile", str(out), *CONVERT_ARGS[family]]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{res.stderr[-3000:]}")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def hf_token_ids(text: str, tokenizer: Path = BUNDLED) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(text).ids


def heldout_slice() -> str:
    return HELDOUT.read_text(encoding="utf-8")[HELDOUT_CHARS[0]:HELDOUT_CHARS[1]]


def transformers_agreement(hf_dir: Path, f32_gguf: Path) -> dict:
    """transformers' fp32 logits for PROMPT on the checkpoint against llama.cpp's on its F32 GGUF:
    the conversion and llama.cpp's forward agree with the reference implementation."""
    import torch
    import transformers as tf

    torch.set_num_threads(1)
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    r = ref.Reference(f32_gguf, PPL_CTX)
    try:
        ids = r.tokenize(PROMPT)
        ours = r.logits(ids)
    finally:
        r.close()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    return {"max_abs_diff": float(np.abs(ours - theirs).max()), "max_abs_logit": float(np.abs(theirs).max()),
            "argmax_equal": bool((ours.argmax(1) == theirs.argmax(1)).all())}


def record(gguf_path: Path, meta: dict, tokenizer: Path = BUNDLED) -> tuple[dict, dict[str, np.ndarray]]:
    """llama.cpp's token ids, prompt logits and perplexity for one GGUF: (json, arrays);
    `tokenizer` is the Hugging Face tokenizer the checkpoint was built with."""
    text = heldout_slice()
    r = ref.Reference(gguf_path, PPL_CTX)
    try:
        held = r.tokenize(text)
        prompt = r.tokenize(PROMPT)
        logits = r.logits(prompt)  # [T, V]
        ppl = r.perplexity(held)
    finally:
        r.close()
    rec = dict(meta)
    rec.update({
        "gguf": gguf_path.name, "sha256": sha256(gguf_path), "bytes": gguf_path.stat().st_size,
        "tensor_types": tensor_types(gguf_path),
        "llama_cpp": {"llama_cpp_python": ref.llama_cpp_version(), "n_threads": 1, "type_k": "F32",
                      "type_v": "F32", "flash_attn": False, "n_ctx": PPL_CTX, "n_batch": PPL_CTX,
                      "n_ubatch": PPL_CTX, "device": "cpu"},
        "heldout": {"file": str(HELDOUT.relative_to(ROOT)), "chars": list(HELDOUT_CHARS),
                    "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": held,
                    "hf_tokenizer_equal": held == hf_token_ids(text, tokenizer)},
        "prompt": {"text": PROMPT, "tokens": prompt, "logits": "logits", "logits_shape": list(logits.shape)},
        "perplexity": ppl,
    })
    return rec, {"logits": logits}


def write_recording(gguf_path: Path, rec: dict, arrays: dict[str, np.ndarray]) -> None:
    stem = gguf_path.with_suffix("")
    Path(f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    np.savez_compressed(f"{stem}.npz", **arrays)


def check(out: Path) -> int:
    """Recompute every recording in `out` with llama.cpp; print each mismatch; count them."""
    recs = sorted(p for p in [*out.glob("*.json"), *out.glob("*/*.json")] if p.with_suffix(".gguf").is_file())
    if not recs:
        print(f"no recordings in {out}")
        return 1
    bad = 0
    for path in recs:
        old = json.loads(path.read_text())
        gguf_path = path.parent / old["gguf"]
        problems = []
        if sha256(gguf_path) != old["sha256"]:
            problems.append("the GGUF file's sha256 differs from the recording's")
        new, arrays = record(gguf_path, {})
        old_logits = np.load(path.with_suffix(".npz"))["logits"]
        if new["heldout"]["tokens"] != old["heldout"]["tokens"]:
            problems.append("held-out token ids differ")
        if new["prompt"]["tokens"] != old["prompt"]["tokens"]:
            problems.append("prompt token ids differ")
        elif arrays["logits"].shape != old_logits.shape:
            problems.append(f"logits shape {arrays['logits'].shape} != {old_logits.shape}")
        else:
            diff = float(np.abs(arrays["logits"] - old_logits).max())
            scale = float(np.abs(old_logits).max())
            if diff > LOGIT_TOL * max(scale, 1.0):
                problems.append(f"logits differ by up to {diff:.3g} (max |logit| {scale:.3g})")
        for i, (a, b) in enumerate(zip(new["perplexity"]["chunk_nll"], old["perplexity"]["chunk_nll"])):
            if abs(a - b) > PPL_TOL * abs(b):
                problems.append(f"chunk {i} NLL {a!r} != recorded {b!r}")
        same = np.array_equal(arrays["logits"], old_logits)
        status = "; ".join(problems) or ("ok (logits bitwise equal)" if same else "ok (within tolerance)")
        ppl_new, ppl_old = new["perplexity"]["ppl"], old["perplexity"]["ppl"]
        print(f"{old['gguf']}: ppl {ppl_new:.6f} (recorded {ppl_old:.6f}): {status}")
        bad += bool(problems)
    return bad


def rebuild(llama_dir: Path, work: Path, out: Path, families: list[str] | None = None) -> None:
    """Build every family (or `families`) and quantization in `work`, record each, copy those of
    COMMITTED made to `out`."""
    made: dict[str, dict] = {}
    refused: dict[str, str] = {}
    for fam, spec in FAMILIES.items():
        if families and fam not in families:
            continue
        tok = tokenizer_dir(spec, ROOT, BUNDLED)
        hf = build_checkpoint(spec, tok, work / "hf" / fam)
        try:
            f32 = convert(llama_dir, fam, hf, work / f"{fam}-F32.gguf")
            agreement = transformers_agreement(hf, f32)
        except (RuntimeError, ValueError) as e:
            refused[fam] = str(e).splitlines()[-1]
            print(f"{fam}: llama.cpp refused: {refused[fam]}")
            continue
        meta = {"family": fam, "hf_config": json.loads((hf / "config.json").read_text()), "seed": spec.seed,
                "converted_with": {"script": "convert_hf_to_gguf.py", "outtype": "f32", "tokenizer_pre": "gpt-2"}}
        meta["f32_vs_transformers"] = agreement
        print(f"{f32.name}: transformers (fp32) vs llama.cpp logits: {meta['f32_vs_transformers']}")
        jobs = [(f32, None, None)] + [(work / f"{fam}-{q}.gguf", q, None) for q in QUANTS[fam]]
        if fam == "qwen3_moe":
            jobs.append((work / f"{fam}-mix.gguf", "Q4_K_M", MIX))
        for path, ftype, over in jobs:
            try:
                if ftype:
                    ref.quantize(f32, path, ftype, overrides=over)
            except RuntimeError as e:
                refused[path.stem] = str(e).splitlines()[-1]
                print(f"{path.name}: llama.cpp refused: {refused[path.stem]}")
                continue
            rec, arrays = record(path, {**meta, "ftype": ftype or "F32", "tensor_type_overrides": over}, tok)
            write_recording(path, rec, arrays)
            made[path.stem] = rec
            types = sorted(set(rec["tensor_types"].values()))
            print(f"{path.name}: {rec['bytes'] / 1e6:.2f} MB, ppl {rec['perplexity']['ppl']:.4f}, "
                  f"hf tokens equal {rec['heldout']['hf_tokenizer_equal']}, types {' '.join(types)}")
    (work / "summary.json").write_text(json.dumps({"refused": refused, "made": {
        k: {"bytes": v["bytes"], "types": sorted(set(v["tensor_types"].values())), "ppl": v["perplexity"]["ppl"]}
        for k, v in made.items()}}, indent=1) + "\n")
    committed = [n for n in COMMITTED if not families or made.get(Path(n).name, {}).get("family") in families
                 or Path(n).name.split("-")[0] in families]
    absent = [name for name in committed if Path(name).name not in made]
    if absent:
        raise SystemExit(f"fixtures to commit were not made: {absent}")
    if not families:
        covered = {t for name in committed for t in made[Path(name).name]["tensor_types"].values()}
        missing = [t for t in REQUIRED_TYPES if t not in covered]
        if missing:
            raise SystemExit(f"the committed fixtures lack tensor types {missing}")
    for name in committed:
        stem = Path(name).name
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        prev = out / f"{name}.gguf"
        if prev.is_file():
            same = sha256(prev) == made[stem]["sha256"]
            print(f"{name}.gguf: {'rebuilt byte for byte' if same else 'DIFFERS from the file it replaces'}")
        for suffix in (".gguf", ".json", ".npz"):
            shutil.copyfile(work / f"{stem}{suffix}", out / f"{name}{suffix}")
    total = sum((out / f"{n}{s}").stat().st_size for n in committed for s in (".gguf", ".json", ".npz"))
    print(f"committed set: {', '.join(committed)}; {total / 1e6:.2f} MB in {out}")


def bundled(llama_dir: Path, outdir: Path) -> dict:
    """The bundled model as GGUF (F32, BF16, Q8_0, Q4_K_M) and llama.cpp's perplexity of each on
    all of heldout.txt at n_ctx 512."""
    outdir.mkdir(parents=True, exist_ok=True)
    f32 = ref.convert(llama_dir, BUNDLED, outdir / "tiny-qwen3-moe-F32.gguf", "f32")
    files = {"F32": f32, "BF16": ref.convert(llama_dir, BUNDLED, outdir / "tiny-qwen3-moe-BF16.gguf", "bf16")}
    for q in ("Q8_0", "Q4_K_M"):
        files[q] = ref.quantize(f32, outdir / f"tiny-qwen3-moe-{q}.gguf", q)
    text = HELDOUT.read_text(encoding="utf-8")
    result = {"model": str(BUNDLED.relative_to(ROOT)), "text": str(HELDOUT.relative_to(ROOT)),
              "n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "n_threads": 1, "type_k": "F32", "type_v": "F32",
              "flash_attn": False, "llama_cpp_python": ref.llama_cpp_version(), "method":
              "llama-perplexity's: tokenized once, chunks of n_ctx, BOS over each chunk's first token when the "
              "vocab adds BOS, positions n_ctx/2..n_ctx-2 scored (tools/llamacpp_ref.py)", "files": {}}
    for q, path in files.items():
        r = ref.Reference(path, 512)
        try:
            tokens = r.tokenize(text)
            ppl = r.perplexity(tokens)
        finally:
            r.close()
        ppl["hf_tokenizer_equal"] = tokens == hf_token_ids(text)
        result["files"][q] = {"gguf": path.name, "bytes": path.stat().st_size, "sha256": sha256(path),
                              "types": sorted(set(tensor_types(path).values())), **ppl}
        print(f"{path.name}: ppl {ppl['ppl']:.4f} +/- {ppl['ppl_uncertainty']:.4f} over {ppl['chunks']} chunks")
    (outdir / "bundled_ppl.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "gguf")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gguf-fixtures"),
                    help="where everything is built; --rebuild empties it first: a new folder or an earlier --work")
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"),
                    help="llama.cpp source tree holding convert_hf_to_gguf.py (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--rebuild", action="store_true", help="build the fixtures and recordings again")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="with --rebuild: only this family (repeatable)")
    ap.add_argument("--bundled", type=Path, metavar="OUTDIR", help="convert the bundled model and record its ppl")
    args = ap.parse_args(argv)
    if (args.rebuild or args.bundled) and args.llama_cpp is None:
        ap.error("--rebuild and --bundled need --llama-cpp DIR (or LLAMA_CPP_DIR)")
    if args.bundled:
        bundled(args.llama_cpp, args.bundled)
        return 0
    if args.rebuild:
        if args.work.is_symlink() or args.work.exists() and not args.work.is_dir():
            ap.error(f"--work {str(args.work)!r} is not a directory: expected a new or an earlier --work folder")
        if args.work.exists() and any(args.work.iterdir()):
            # Emptied before the build: only a folder an earlier --rebuild made, never one of the user's.
            if not (args.work / WORK_MARKER).is_file():
                ap.error(f"--work {str(args.work)!r} holds files that --rebuild did not write (no {WORK_MARKER} "
                         "in it): expected a new folder or an earlier --work; remove it yourself to reuse it")
            shutil.rmtree(args.work)
        args.work.mkdir(parents=True, exist_ok=True)
        (args.work / WORK_MARKER).write_text("made by tools/make_gguf_fixtures.py --rebuild; emptied by the next\n")
        rebuild(args.llama_cpp, args.work, args.out, args.family)
    bad = check(args.out)
    print(f"{bad} recording(s) disagree with llama.cpp" if bad else "all recordings agree with llama.cpp")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
