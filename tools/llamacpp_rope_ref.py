"""llama.cpp's logits with its RoPE scaling flags (`--rope-scaling`, `--rope-scale`,
`--yarn-orig-ctx`), the reference for `tests/test_rope_llamacpp.py`: writes
tests/fixtures/llamacpp/rope_scaling.json. Needs llama-cpp-python (it is never run in CI):

    python tools/llamacpp_rope_ref.py [--work DIR]   (DIR: keep the GGUF files it builds)

The model is tests/fixtures/gguf/qwen3_moe-mix.gguf with its weights dequantized to F32 (so that
both engines compute the same function up to the order of fp32 sums) and its context length cut
to CONTEXT tokens, so that a prompt of N_TOKENS runs far past it; `build()` writes it and its
copies with the scaling keys of FILES (the test builds the same files). llama.cpp runs as every recording here does (tools/llamacpp_ref.py:
one thread, F32 K/V cache, flash attention off), with each case's flags passed as llama-cli's
are: rope_scaling_type, rope_freq_scale = 1 / --rope-scale, yarn_orig_ctx. The recording holds
llama.cpp's four largest logits with their ids at every EVERY-th position of each case.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
RECORDING = ROOT / "tests" / "fixtures" / "llamacpp" / "rope_scaling.json"
ARCH = "qwen3moe"
CONTEXT = 64           # the files' context_length: the prompt is 5x as long
N_TOKENS, EVERY, TOP = 320, 4, 4
SEED = 0

# file -> the scaling keys it carries (llama.cpp's converter, Qwen3's "128K" rope_scaling)
# and the keys llama.cpp reads whatever they scale by (a type of none, YaRN at factor 1, an original
# context without a type)
FILES = {"plain": {}, "yarn": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                               "rope.scaling.original_context_length": CONTEXT},
         "none": {"rope.scaling.type": "none"},
         "yarn1": {"rope.scaling.type": "yarn", "rope.scaling.factor": 1.0,
                   "rope.scaling.original_context_length": CONTEXT // 2},
         "orig": {"rope.scaling.original_context_length": CONTEXT // 2}}

# case -> (file, llama.cpp's flags as {flag: value}); the test passes the same flags to ours
CASES = {
    "plain": ("plain", {}),
    "yarn 4 orig 0": ("plain", {"--rope-scaling": "yarn", "--rope-scale": 4.0, "--yarn-orig-ctx": 0}),
    "yarn 4 orig 32": ("plain", {"--rope-scaling": "yarn", "--rope-scale": 4.0, "--yarn-orig-ctx": 32}),
    "yarn 3 orig 48": ("plain", {"--rope-scaling": "yarn", "--rope-scale": 3.0, "--yarn-orig-ctx": 48}),
    "scale 2": ("plain", {"--rope-scale": 2.0}),
    "file yarn": ("yarn", {}),
    "file yarn, none": ("yarn", {"--rope-scaling": "none"}),
    "file yarn, scale 2": ("yarn", {"--rope-scale": 2.0}),
    "file yarn, orig 32": ("yarn", {"--yarn-orig-ctx": 32}),
    "file yarn, linear": ("yarn", {"--rope-scaling": "linear"}),
    "file none, scale 2": ("none", {"--rope-scale": 2.0}),  # llama.cpp: unscaled (ours refuses it)
    "file yarn1": ("yarn1", {}),
    "file yarn1, scale 4": ("yarn1", {"--rope-scale": 4.0}),
    "file orig, yarn 4": ("orig", {"--rope-scaling": "yarn", "--rope-scale": 4.0}),
}


def tokens() -> list[int]:
    """N_TOKENS ids drawn from the vocabulary (the model is random: text means nothing to it)."""
    return np.random.default_rng(SEED).integers(1, 4096, N_TOKENS).tolist()


def build(name: str, out: Path) -> Path:
    """FILES[name] written to `out`: SOURCE's weights in F32, its metadata with context_length
    CONTEXT and the file's scaling keys."""
    import gguf
    from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

    reader = GGUFReader(SOURCE)
    w = GGUFWriter(str(out), ARCH)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        value = CONTEXT if key == f"{ARCH}.context_length" else f.contents()
        w.add_key_value(key, value, f.types[0], f.types[1] if len(f.types) > 1 else None)
    types = {str: VT.STRING, float: VT.FLOAT32, int: VT.UINT32}
    for key, value in FILES[name].items():
        w.add_key_value(f"{ARCH}.{key}", value, types[type(value)])
    for t in reader.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def llama_cpp_args(flags: dict) -> dict:
    """llama-cli's flags as llama_cpp.Llama's arguments (common/arg.cpp: --rope-scale F sets
    rope_freq_scale 1/F)."""
    import llama_cpp

    kinds = {"none": llama_cpp.LLAMA_ROPE_SCALING_TYPE_NONE, "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
             "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN}
    out = {}
    if "--rope-scaling" in flags:
        out["rope_scaling_type"] = kinds[flags["--rope-scaling"]]
    if "--rope-scale" in flags:
        out["rope_freq_scale"] = 1.0 / flags["--rope-scale"]
    if "--yarn-orig-ctx" in flags:
        out["yarn_orig_ctx"] = flags["--yarn-orig-ctx"]
    return out


def llama_cpp_logits(path: Path, ids: list[int], flags: dict) -> np.ndarray:
    import llama_cpp

    n = len(ids)
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n, n_batch=n, n_ubatch=n, n_threads=1, n_threads_batch=1, logits_all=True,
        flash_attn=False, n_gpu_layers=0, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False, **llama_cpp_args(flags))
    try:
        llm.eval(ids)
        return np.array(llm.scores[:n], dtype=np.float32, copy=True)
    finally:
        llm.close()


def _top(row: np.ndarray) -> tuple[list[int], list[float]]:
    ids = np.argsort(-row, kind="stable")[:TOP]
    return [int(i) for i in ids], [round(float(row[i]), 5) for i in ids]


def record(out: Path = RECORDING, work: Path | None = None) -> dict:
    import tempfile

    import llama_cpp

    ids = tokens()
    rec = {"llama_cpp": {"llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"), "n_threads": 1,
                         "type_k": "F32", "type_v": "F32", "flash_attn": False},
           "source": str(SOURCE.relative_to(ROOT)), "context_length": CONTEXT, "every": EVERY,
           "tokens": ids, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(work or tmp)
        paths = {name: build(name, d / f"{name}.gguf") for name in FILES}
        plain = None
        for case, (name, flags) in CASES.items():
            logits = llama_cpp_logits(paths[name], ids, flags)
            if plain is None:
                plain = logits
            rows = [_top(logits[j]) for j in range(0, N_TOKENS, EVERY)]
            rec["cases"][case] = {"file": name, "flags": flags, "ids": [r[0] for r in rows],
                                  "logits": [r[1] for r in rows]}
            print(f"{case}: max |logit - plain's| past {CONTEXT}: {np.abs(logits - plain)[CONTEXT:].max():.3g}",
                  flush=True)
    out.write_text(json.dumps(rec, separators=(",", ":")) + "\n")
    return rec


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RECORDING, help="the recording (default: %(default)s)")
    p.add_argument("--work", type=Path, help="keep the GGUF files built here (default: a temporary folder)")
    args = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"this tool needs llama-cpp-python (pip install llama-cpp-python): {e}") from None
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    record(args.out, args.work)


if __name__ == "__main__":
    main()
