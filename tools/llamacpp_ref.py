"""llama.cpp as the reference: convert, quantize, tokenize, logits and perplexity, through
llama.cpp's own converter script and llama-cpp-python (`llama_cpp`).

Every evaluation runs on the CPU with one thread, an F32 K/V cache and flash attention off, so
that a recording depends only on the GGUF file and the llama.cpp build. Perplexity follows
llama-perplexity (tools/perplexity/perplexity.cpp, `perplexity()`): the text is tokenized once
with special tokens added (BOS where the vocabulary adds it), cut into chunks of n_ctx tokens,
each chunk evaluated from an empty K/V cache with its first token replaced by BOS when the
vocabulary adds BOS, and the logits at positions n_ctx/2 .. n_ctx-2 scored against the next token
(a log-softmax with the max in fp32 and the sum of exponentials in fp64).
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import llama_cpp
except ImportError as e:  # pragma: no cover - the message is the point
    raise SystemExit(f"this tool needs llama-cpp-python (pip install llama-cpp-python): {e}") from None

# A BPE tokenizer whose pre-tokenizer llama.cpp's converter does not know by hash is named here.
# 'gpt-2' is llama.cpp's name for the plain GPT-2 byte-level split (ByteLevel with use_regex),
# which is what the bundled tokenizer.json uses; 'qwen2' would split digits and newlines apart.
_CONVERT_BOOTSTRAP = r"""
import sys
from pathlib import Path
root, pre = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(root))
sys.argv = [str(root / "convert_hf_to_gguf.py")] + sys.argv[3:]
import convert_hf_to_gguf as cv
from conversion.base import TextModel
detect = TextModel.get_vocab_base_pre
def named_pre(self, tokenizer):
    try:
        return detect(self, tokenizer)
    except NotImplementedError:
        return pre
TextModel.get_vocab_base_pre = named_pre
cv.main()
"""

FTYPES = {  # llama-quantize's names -> llama_ftype
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1, "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M, "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M, "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "IQ4_NL": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL, "IQ4_XS": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
}


def convert(converter_dir: Path, hf_dir: Path, out: Path, outtype: str = "f32",
            tokenizer_pre: str = "gpt-2") -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on `hf_dir`, naming the pre-tokenizer `tokenizer_pre`
    when the converter does not recognise it (weights are converted exactly as the script does)."""
    if not (converter_dir / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no convert_hf_to_gguf.py in {converter_dir} (pass the llama.cpp source tree)")
    cmd = [sys.executable, "-c", _CONVERT_BOOTSTRAP, str(converter_dir), tokenizer_pre,
           str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{res.stderr[-3000:]}")
    return out


def quantize(src: Path, out: Path, ftype: str, overrides: dict[str, str] | None = None,
             token_embd: str | None = None, output: str | None = None) -> Path:
    """llama_model_quantize(src -> out) with llama-quantize's `ftype`; `overrides` maps tensor-name
    regexes to ggml type names (llama-quantize --tensor-type), `token_embd`/`output` set those two
    tensors' types (--token-embedding-type / --output-tensor-type)."""
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 1
    if token_embd:
        params.token_embedding_type = ggml_type(token_embd)
    if output:
        params.output_tensor_type = ggml_type(output)
    keep = []
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, tname) in enumerate(overrides.items()):
            keep.append(pattern.encode())
            arr[i].pattern = keep[-1]
            arr[i].type = ggml_type(tname)
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {ftype}) returned {rc}")
    return out


def ggml_type(name: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[name])


@dataclass
class Reference:
    """One GGUF file opened in llama.cpp the way every recording is made."""

    path: Path
    n_ctx: int

    def __post_init__(self):
        self.llm = llama_cpp.Llama(
            model_path=str(self.path), n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
            n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=False, n_gpu_layers=0,
            type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self.llm._model.vocab))

    @property
    def bos_id(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self.llm._model.vocab))

    def tokenize(self, text: str) -> list[int]:
        """llama-perplexity's tokenization: special tokens added, special text not parsed."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """fp32 logits at every position of `tokens` from an empty K/V cache: [T, V]."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens, expected 1..{self.n_ctx}")
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32, copy=True)

    def perplexity(self, tokens: list[int]) -> dict:
        """llama-perplexity's number over `tokens` (see the module doc), with per-chunk NLL sums."""
        n_ctx = self.n_ctx
        n_chunks = len(tokens) // n_ctx
        if n_chunks < 2:
            raise ValueError(f"{len(tokens)} tokens: perplexity needs at least 2 * n_ctx = {2 * n_ctx}")
        first = n_ctx // 2
        chunk_nll, count, nll2 = [], 0, 0.0
        for c in range(n_chunks):
            chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
            if self.add_bos:
                chunk[0] = self.bos_id
            logits = self.logits(chunk)
            nll = 0.0
            for j in range(first, n_ctx - 1):
                row = logits[j]
                mx = np.float32(row.max())
                sum_exp = float(np.sum(np.exp(row - mx).astype(np.float64)))
                v = math.log(sum_exp) - float(row[tokens[c * n_ctx + j + 1]] - mx)
                nll += v
                nll2 += v * v
                count += 1
            chunk_nll.append(nll)
        mean = sum(chunk_nll) / count
        var = nll2 / count - mean * mean
        return {
            "n_ctx": n_ctx, "n_tokens": len(tokens), "chunks": n_chunks, "scored_per_chunk": n_ctx - 1 - first,
            "add_bos": self.add_bos, "bos_id": self.bos_id if self.add_bos else None,
            "chunk_nll": chunk_nll, "ppl": math.exp(mean),
            "ppl_uncertainty": math.sqrt(var / (count - 1)) * math.exp(mean) if var > 0 else None,
        }

    def close(self) -> None:
        self.llm.close()


def llama_cpp_version() -> str:
    return getattr(llama_cpp, "__version__", "unknown")
