"""Where our forward and llama.cpp's part: each layer's residual stream and router choice, side
by side, at the positions asked for.

    python tools/llama_intermediates.py FILE.gguf [--chunk C | --prompt] [--positions 67,68]
        [--dtype float32] [--activations q8]

FILE.gguf is a fixture with its recording beside it (tests/fixtures/gguf: FILE.json holds the
tokens): `--chunk C` takes chunk C of the held-out tokens as the perplexity recording cuts them
(its first token BOS where the vocabulary adds one), `--prompt` the recorded prompt.
llama.cpp's tensors are read with its graph callback (`cb_eval`) as each is computed: the residual
stream after each layer's mixer (`attn_residual-L`, Gemma 4's `attn_out-L`) and the router's
choice (`ffn_moe_topk-L`); ours come from the decoder's hooks at the same points. Prints per
layer the largest difference relative to llama.cpp's row and whether the top-k sets agree, then
one JSON line. The first layer and position where the difference jumps is where to look (docs/gguf.md:
that is how a one-ulp norm was found to flip an 8-bit rounding). Needs llama-cpp-python 0.3.36
(the ggml_tensor layout below is its ggml.h's).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_ref import Reference, llama_cpp  # noqa: E402  (exits with a message without llama-cpp-python)

import expertcache  # noqa: E402

GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
WANTED = ("attn_residual", "attn_out", "ffn_moe_topk")


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h): GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64 bytes,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def read_tensor(t: GGMLTensor) -> np.ndarray | None:
    """A computed F32/I32 tensor as [rows, ne0] (strided views copied), or None for other types."""
    if not t.data or t.type not in (GGML_TYPE_F32, GGML_TYPE_I32) or t.nb[0] != 4:
        return None
    ne, nb = list(t.ne), list(t.nb)
    size = sum((ne[i] - 1) * nb[i] for i in range(4)) + 4
    raw = np.frombuffer((ctypes.c_char * size).from_address(t.data), dtype=np.uint8)
    dtype = np.float32 if t.type == GGML_TYPE_F32 else np.int32
    arr = np.lib.stride_tricks.as_strided(raw.view(dtype), shape=(ne[3], ne[2], ne[1], ne[0]),
                                          strides=(nb[3], nb[2], nb[1], nb[0]))
    return arr.reshape(-1, ne[0]).copy()


def llama_tensors(path: Path, tokens: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """llama.cpp's WANTED tensors (by name, `base-layer`) and logits [T, V] for one evaluation."""
    captured: dict[str, np.ndarray] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def on_tensor(ptr, ask, _user):
        t = ctypes.cast(ptr, ctypes.POINTER(GGMLTensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return name.rsplit("-", 1)[0] in WANTED
        arr = read_tensor(t)
        if arr is not None:
            captured[name] = arr
        return True

    ref = Reference(path, max(len(tokens), 8))
    llm = ref.llm
    # The callback belongs to the context: a new one with it set (llama-cpp-python has no argument for it).
    llm.context_params.cb_eval = on_tensor
    llm._ctx = llama_cpp._internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    logits = ref.logits(tokens)
    return captured, logits


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", type=Path)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chunk", type=int, default=0, help="chunk of the recording's held-out tokens (default 0)")
    g.add_argument("--prompt", action="store_true", help="the recording's prompt instead")
    p.add_argument("--positions", default=None, help="comma-separated positions (default: the first where "
                   "the logits part by more than 1e-4, and the one before)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--activations", default="q8")
    args = p.parse_args(argv)
    rec_path = args.gguf.with_suffix(".json")
    if not rec_path.exists():
        p.error(f"{rec_path} not found: expected the fixture's recording beside the GGUF")
    rec = json.loads(rec_path.read_text())
    if args.prompt:
        tokens = list(rec["prompt"]["tokens"])
    else:
        n = rec["perplexity"]["n_ctx"]
        tokens = list(rec["heldout"]["tokens"][args.chunk * n:(args.chunk + 1) * n])
        if rec["perplexity"].get("add_bos"):
            tokens[0] = rec["perplexity"]["bos_id"]

    theirs, their_logits = llama_tensors(args.gguf, tokens)
    model = expertcache.load(args.gguf, dtype=args.dtype, activations=args.activations)
    ours: dict[str, np.ndarray] = {}
    model.net.residual_hook = lambda i, h: ours.__setitem__(f"residual-{i}", h.float().numpy().copy())
    model.net.routing_hook = lambda i, r: ours.__setitem__(f"topk-{i}", r.ids.numpy().copy())
    our_logits = model.logits(tokens).float().numpy()

    by_pos = [rel(our_logits[j], their_logits[j]) for j in range(len(tokens))]
    if args.positions:
        positions = [int(v) for v in args.positions.split(",")]
    else:
        first = next((j for j, v in enumerate(by_pos) if v > 1e-4), None)
        positions = [] if first is None else sorted({max(first - 1, 0), first})
    print(f"{args.gguf.name}: {len(tokens)} tokens, {args.dtype}, activations {args.activations}; logits "
          f"relative difference: largest {max(by_pos):.1e}, first above 1e-4 at "
          f"{next((j for j, v in enumerate(by_pos) if v > 1e-4), None)}")
    out = {"tool": "llama_intermediates", "file": args.gguf.name, "logits_rel": by_pos, "layers": []}
    for layer in range(model.cfg.num_layers):
        a = ours.get(f"residual-{layer}")
        b = theirs.get(f"attn_residual-{layer}", theirs.get(f"attn_out-{layer}"))
        row = {"layer": layer}
        cells = []
        for j in positions:
            if a is not None and b is not None and b.shape == a.shape:
                row[f"residual_rel_{j}"] = rel(a[j], b[j])
                cells.append(f"pos {j}: residual {row[f'residual_rel_{j}']:.1e}")
            ta, tb = ours.get(f"topk-{layer}"), theirs.get(f"ffn_moe_topk-{layer}")
            if ta is not None and tb is not None:
                row[f"topk_equal_{j}"] = sorted(ta[j].tolist()) == sorted(tb[j].tolist())
                cells[-1:] = [(cells[-1] + ", " if cells else f"pos {j}: ")
                              + ("top-k equal" if row[f"topk_equal_{j}"] else
                                 f"top-k ours {sorted(ta[j].tolist())} llama.cpp {sorted(tb[j].tolist())}")]
        out["layers"].append(row)
        print(f"layer {layer:3d}  " + "; ".join(cells))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
