"""Which kernels run the decode step: torch's own or the small native ones in
`native/decode.cpp` and, for quantized blocks, `native/quant.cpp` (`--kernels`; auto: native for a
bf16 or quantized model on the CPU where they build).

A decode step streams every active weight once through one-row products, and between them runs
a few hundred small torch ops that each cost a dispatch. torch's one-row bf16 product widens
every weight to fp32 before its multiply-add and streams the weights well below the rate this
kind of CPU can read them (`tools/gemv_probe.py`). The native kernels multiply bf16 pairs
directly where the CPU has AVX512-BF16, run a whole wave of a decode step's experts in one call
instead of five torch ops per expert, and do an RMSNorm (either family's rounding), and all of
attention between the two projections (q/k norm, rotary, the cache append, softmax over the
cache), in one call each.
Over quantized blocks (GGUF files, whose dense matrices then stay blocks too: `QuantTensor`,
`linear_blocks`) a decode step rounds each product's input to 8 bits per block and multiplies
integer blocks, as llama.cpp does (`--activations`, `ACTIVATIONS_CHOICES`). The native kernels:

- are compiled on first use (about a minute; then cached by torch under
  ~/.cache/torch_extensions), which needs a C++ compiler, the Python headers and ninja; where
  that fails, auto says so in one line and uses torch's;
- sum in a different order than torch's (and rotary and attention are rounded once, in fp32,
  where torch rounds each op in bf16), so bf16 results differ from torch's kernels in the last
  bits. Within one kernel choice results are still identical across cache modes, sizes and
  policies, and the native kernels' across thread counts too: each output element is one row's
  dot product, summed by one thread in a fixed order. torch's products (oneDNN, MKL) may split a
  sum by thread count, so a prompt's logits can change with `-t` (never with the cache).

Only one-row work on the CPU takes the native paths (a decode step, the last row of a prompt),
and products of up to `act8_rows` rows over quantized blocks (`gemm_act8`), and on AVX2 bf16
products of fewer than `NATIVE_ROWS` rows (`linear_rows`: a prompt's tokens routed to one expert);
prefill's other products use torch (quantized weights decoded a block of rows at a time).
A decode step's attention is one native call in every family (`attend`; Gemma 4's `attend_scaled`,
over its sliding ring too; Qwen3.5's gated `attend_gated`), except with clipped q/k/v or a
whole-projection q/k norm (OLMoE) or a sliding window in the shared attention, which stay on torch.
The choice belongs to a model: it holds one `Kernels` object (`TorchKernels` or
`NativeKernels`) and passes it to every layer; nothing reads a process-wide setting, so models
with different choices can run side by side.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from ..checkpoint.storage import QuantTensor, RowParts
from ..errors import ExpertCacheError
from ..memory import host_zeros

KERNELS = ("auto", "torch", "native")
# How the activations of products with quantized weights are taken: as they are (exact), or
# rounded to 8 bits per block first (q8), as llama.cpp's CPU products do; auto is q8 where the
# native kernels run a quantized model (bf16 on the CPU), for products of up to AUTO_ACT8_ROWS
# rows on a CPU with bf16 matrix instructions and for every product on one without, and exact
# elsewhere (`select`).
ACTIVATIONS_CHOICES = ("auto", "exact", "q8")
# Rows up to which `auto` takes the integer kernels (above it a bf16 GEMM of the decoded weights is
# faster here: Q4_K 1.9x faster at 12 rows, even at 20; Q8_0 even at 10), and "every row count".
AUTO_ACT8_ROWS = 8
ALL_ROWS = 1 << 62
# The types whose eight-row tiles (`Kernels.tiles`) take exactly as many bytes as their rows: Q4_K
# (1152 bytes for eight rows' super-blocks) and Q8_0 (272 for eight rows' blocks). The others'
# tiles are wider (Q6_K's six-bit values as bytes, the 4/5-bit 32-weight types as bytes), so a
# decode step would read more; their tiles are formed per product, for prefill, instead.
TILED_TYPES = (Q.Q4_K, Q.Q8_0)
SOURCE = Path(__file__).parent.parent / "native" / "decode.cpp"

_loaded: dict[bool, ModuleType] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_native(stem: str, source: Path, what: str, extra_flags: tuple[str, ...] = (),
                 portable: bool = False) -> ModuleType:
    """Build (first use, about a minute; then cached by torch) or load a native module of this
    package; one line of error naming `what` if that cannot be done.

    -fopenmp: at::parallel_for is inline and splits work across threads only when compiled with
    OpenMP. -march=native compiles for this CPU, so the build is named after the CPU's features
    and the source: a cache directory shared with another machine or checkout never hands it a
    build for a different CPU or source.
    `portable=True` builds the loop that CPUs without the wide instructions get, on any CPU."""
    from torch.utils import cpp_extension

    # The source is in the name too, with the headers beside it that the modules share: two
    # checkouts with different sources (a worktree beside the main one) then never build over,
    # or load, each other's module. So is the torch it compiles against: the build's command
    # line names torch's headers by path, and a second environment (a CI clone's) would rebuild
    # the module on every start from one or the other.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    torch_dir = str(Path(torch.__file__).resolve().parent).encode()
    tag = hashlib.sha1(_cpu_flags().encode() + source.read_bytes() + headers + torch_dir).hexdigest()[:10]
    name = f"expertcache_{stem}_{tag}" + ("_portable" if portable else "")
    flags = ["-O3", "-march=native", "-fopenmp", *extra_flags] + (["-DEXPERTCACHE_PORTABLE"] if portable else [])
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise ExpertCacheError(f"{what}: ninja was not found; expected it on PATH "
                               "(pip install ninja, or pip install 'expertcache[native]')") from None
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob("*.so")):
        print(f"expertcache: building the {what} (first use only, about a minute)", file=sys.stderr, flush=True)
    # Compiled from a copy in the build directory, which the name ties to the source's content:
    # the build file names the sources' paths, so two checkouts of the same source (a CI clone, a
    # worktree) compiling from their own paths rebuilt each other's module on every start.
    try:
        with _build_lock(build_dir, what):
            staged = _stage_sources(source, build_dir / "src")
            return cpp_extension.load(name, sources=[str(staged)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                      verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise ExpertCacheError(f"{what}: could not be built ({first}); expected a C++ compiler (g++) "
                               "and the Python headers") from None


@contextlib.contextmanager
def _build_lock(build_dir: Path, what: str):
    """Held while a module is built or loaded. torch marks a build with a lock file that only a
    process that ends normally removes: one killed in its first build (SIGTERM, SIGKILL) left it,
    and every later process then waited for it forever, without a word. This lock is the
    kernel's (it goes with the process that holds it), so whoever holds it knows that a torch
    lock file found now is such a leftover, and removes it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "expertcache.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"expertcache: waiting for another process building the {what}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"expertcache: removing {stale}, left by a build of the {what} that was killed",
                      file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stage_sources(source: Path, into: Path) -> Path:
    """`source` and the headers beside it, copied into `into` where missing or different (each
    file replaced whole: processes starting together may stage at once); the staged source."""
    into.mkdir(parents=True, exist_ok=True)
    for f in [source, *sorted(source.parent.glob("*.h"))]:
        data, dst = f.read_bytes(), into / f.name
        if not dst.exists() or dst.read_bytes() != data:
            tmp = into / f".{f.name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return into / source.name


def load_native(portable: bool = False) -> ModuleType:
    """The native decode kernels (`--kernels native`), built on first use."""
    if portable not in _loaded:
        _loaded[portable] = build_native("decode", SOURCE, "--kernels native: the native decode kernels",
                                         portable=portable)
    return _loaded[portable]


def check_choice(kernels: str, device: torch.device, dtype: torch.dtype, activations: str = "auto") -> None:
    """Checks that a kernel choice applies to this device and dtype, before anything is built."""
    if kernels not in KERNELS:
        raise ExpertCacheError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")
    if activations not in ACTIVATIONS_CHOICES:
        raise ExpertCacheError(f"activations {activations!r} is not one of {', '.join(ACTIVATIONS_CHOICES)}")
    if activations == "q8" and device.type != "cpu":
        raise ExpertCacheError(f"--activations q8 runs on the CPU; got device {device}, expected cpu")
    if kernels in ("torch", "auto"):
        return
    if device.type != "cpu":
        raise ExpertCacheError(f"--kernels native runs on the CPU; got device {device}, expected cpu")
    if dtype != torch.bfloat16:
        raise ExpertCacheError(f"--kernels native computes in bfloat16; got dtype {str(dtype).removeprefix('torch.')}, "
                               "expected bfloat16 (--dtype bfloat16)")


def select(kernels: str, device: torch.device, dtype: torch.dtype, quantized: bool = False,
           activations: str = "auto") -> Kernels:
    """The kernel set for a model: torch's, or the native one (built on first use).

    `auto` (the default) is native where it applies and builds: a bf16 model on the CPU (fp32 is
    the exact reference path and stays on torch, as does every GPU); where the kernels cannot be
    built (no compiler, no ninja) it says so in one line and uses torch's. `quantized` builds the
    kernels over quantized blocks too, before any weight is read. `activations` (see
    `ACTIVATIONS_CHOICES`) decides whether products with quantized weights round their
    activations to 8 bits first; q8 is llama.cpp's numerics whatever the storage types (with
    `quantized` false, the experts being float, in float32 only: in bf16 it would change
    nothing, and is refused)."""
    check_choice(kernels, device, dtype, activations)
    if activations == "q8" and dtype == torch.float16:  # the 8-bit kernels take fp32 or bf16 rows
        raise ExpertCacheError("--activations q8 rounds float32 or bfloat16 activations; got dtype float16, "
                               "expected --dtype bfloat16 or float32")
    if activations == "q8" and not quantized and dtype != torch.float32:
        # Without quantized experts, q8 is llama.cpp's float numerics: its norms and GELU, and the
        # input rounded to fp16 or bf16 beside F16 and BF16 matrices, which in bf16 is the input
        # itself: it would change nothing there, silently.
        raise ExpertCacheError(f"--activations q8 on a model without quantized experts is llama.cpp's numerics in "
                               f"float32 (its norms and GELU); got dtype {str(dtype).removeprefix('torch.')}, "
                               "expected --dtype float32")
    chosen: Kernels = TorchKernels()
    if not (kernels == "torch" or (kernels == "auto" and (device.type != "cpu" or dtype != torch.bfloat16))):
        try:
            chosen = NativeKernels(load_native())
            if quantized:
                chosen.quant  # noqa: B018 (built now: a failure belongs to the choice, not to a forward)
        except ExpertCacheError as e:
            if kernels == "native":
                raise
            print(f"expertcache: {e}; using torch's kernels (--kernels torch to choose them)", file=sys.stderr,
                  flush=True)
            chosen = TorchKernels()
    # auto: products of few rows (a decode step; the experts few of a prompt's tokens chose) take
    # the integer kernels, 2-4x faster than decoding each weight to fp32 (one row) or than
    # decoding the matrix to bf16 for a GEMM (tools/gemm_act8_probe.py). Where the CPU has bf16
    # matrix instructions (AVX512-BF16, AMX) that holds up to 8 rows, and more rows multiply the
    # exact rows by the weights decoded to bf16. Where it has not, a bf16 GEMM is widened to fp32
    # (`WIDE_ROWS`): before the integer kernels interleaved eight weight rows, a single product of
    # many rows could be faster that way (Q4_K [1536, 2048] at 512 rows, 2 threads, AVX2: 143
    # against 131 GFLOP/s; since then 84 against 199), and a whole prompt never was, with each
    # matrix decoded per call and most expert products a few dozen rows (512 tokens on Qwen3-30B
    # shapes, Q4_K_M: 323-466 tok/s q8 against 242-271 exact; Gemma 4 shapes 172-191 against
    # 118-150; docs/benchmarks.md), so there every product takes the integer kernels.
    # q8 whatever the storage types: on a file of F32, F16 or BF16 weights, llama.cpp's numerics are
    # its norms and GELU, and the fp16 or bf16 rounding of the input beside F16 and BF16 matrices.
    if activations == "q8":
        chosen.act8_rows = ALL_ROWS
    elif quantized and activations == "auto" and isinstance(chosen, NativeKernels):
        chosen.act8_rows = AUTO_ACT8_ROWS if _has_gemm(torch.bfloat16) else ALL_ROWS
    # llama.cpp's numerics in full: its norms too (their outputs are the next rounding's input).
    chosen.ggml_norms = activations == "q8" and dtype == torch.float32
    if chosen.act8:
        chosen.quant  # noqa: B018 (the rounding is native on either kernel set: built now)
    return chosen


_REDUCED = (torch.bfloat16, torch.float16)
_DECODED = (torch.float32, torch.bfloat16)  # the dtypes the native decoder writes


def _rounded(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x rounded to `dtype` (to nearest even, as ggml's fp32 -> fp16/bf16) in x's dtype; x itself
    for None."""
    return x if dtype is None else x.to(dtype).to(x.dtype)


# The gated MLP's activation by `hidden_act`: SwiGLU (silu) or GeGLU (Gemma's tanh-approximated
# gelu). The native expert calls take the same names and compute either in fp32 as torch does.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_gelu_table: list[torch.Tensor] = []


def gelu_ggml(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU of an fp32 x (`GGML_GELU_FP16`, ggml-cpu/vec.h): 0 at or below -10, x at or
    above 10, between them the input rounded to fp16 and looked up in a table of fp16 values of
    the tanh form computed in fp32. transformers' tanh GELU differs from it by up to an fp16 step."""
    if not _gelu_table:
        f = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        inner = 0.7978845608028654 * f * (1.0 + 0.044715 * f * f)  # fp32, in ggml's order
        t = torch.tanh(inner.double()).float()  # tanhf, correctly rounded
        _gelu_table.append((0.5 * f * (1.0 + t)).half().float())
    y = _gelu_table[0][x.half().view(torch.int16).int() & 0xFFFF]
    return torch.where(x <= -10.0, 0.0, torch.where(x >= 10.0, x, y))


# The activations the native expert calls (`native/decode.cpp`, `native/quant.cpp`) compute.
NATIVE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


# Many rows in bf16/fp16 on a CPU without instructions for them (AVX2, most laptops): oneDNN's
# reduced-precision matrix product runs at a seventh of the fp32 one here (9 against 66 GFLOPS on
# one core, [256, 2048] x [2048, 1536]). Widening both operands to fp32 is exact (a bf16 or fp16
# product fits an fp32 mantissa), the sums are fp32 in both, and the widening costs less than the
# difference from about 12 rows on: prefill's products (an expert's rows, attention's
# projections) take this path under torch's kernels, a decode step's never do.
WIDE_ROWS = 16
# Below this many rows a bf16 product on AVX2 takes the native kernel (`linear_rows`), which widens
# the weights in registers: about 90-120 GFLOP/s on two cores from 4 rows on, where the widened
# BLAS product reaches 9-30 at 4-16 rows (a prompt's tokens routed to one expert) and draws level
# at about 128 (`python tools/matmul_probe.py --threads 2`; docs/benchmarks.md).
NATIVE_ROWS = 128
# A block of a weight widened at a time: bounds the temporary (an LM head of 151k rows is 1.2 GB
# in fp32).
WIDE_BLOCK_BYTES = 64 << 20
_GEMM_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_has: dict[torch.dtype, bool] = {}


def _has_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix instructions for `dtype` (then oneDNN's own product is fast)."""
    if dtype not in _has:
        flags = set(_cpu_flags().split())
        _has[dtype] = any(f in flags for f in _GEMM_FLAGS[dtype])
    return _has[dtype]


# Elements per fp64 temporary of `rms_norm_ggml` (8 MB).
GGML_NORM_BLOCK = 1 << 20


def rms_norm_ggml(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of an fp32 x as ggml's CPU op computes it: the squares summed in
    fp64 in order (a cumulative sum is sequential), the mean rounded to fp32, scale =
    1/sqrt(mean + eps) with a correctly rounded root, then (x * scale) * weight.

    With llama.cpp's 8-bit activations the norms feed the rounding of the next product's input,
    and an input one ulp away lands on the other side of a half now and then: on a random model
    with 32-wide rows such a flip moved the logits by 1e-2 from that position on. torch's float
    sqrt and rsqrt are not correctly rounded (one ulp off, seen on rows of `qwen3_5_moe-Q8_0`),
    and its sums run in another order: so the sum and the root are taken in fp64 and rounded where
    ggml rounds them."""
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, GGML_NORM_BLOCK // rows.shape[1])  # rows per fp64 temporary (a long prompt's would be large)
    sums = torch.cat([torch.cumsum((r * r).double(), -1)[:, -1:] for r in rows.split(step)])  # [R, 1] fp64
    mean = (sums / x.shape[-1]).float().view(*x.shape[:-1], 1)
    scale = 1.0 / torch.sqrt((mean + eps).double()).float()  # fp32 division, as 1.0f/sqrtf
    y = x * scale
    return y if weight is None else y * weight


_wide = threading.local()


def _widened(w: torch.Tensor) -> torch.Tensor:
    """w in fp32, in a buffer this thread keeps: a fresh temporary of tens of MB is mapped by the
    OS a page at a time on first touch, which took ten times the widening itself (a [8192, 2048]
    weight, two threads: 28 ms a call into a fresh tensor, 2.8 ms into a mapped buffer)."""
    buf = getattr(_wide, "buf", None)
    if buf is None or buf.numel() < w.numel():
        buf = _wide.buf = host_zeros((w.numel(),), torch.float32)
    return buf[:w.numel()].view(w.shape).copy_(w)


def _linear_in_fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear with the operands widened to fp32 (block by block of w's rows), rounded once."""
    T, N = x.shape[0], w.shape[0]
    xf = x.float()
    step = max(1, WIDE_BLOCK_BYTES // (4 * w.shape[1]))
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    for a in range(0, N, step):
        e = min(a + step, N)
        out[:, a:e] = F.linear(xf, _widened(w[a:e]), None if b is None else b[a:e].float())
    return out


# oneDNN's switch is one for the whole process, and `_mv_without_onednn` turns it off for the
# length of its product. Calls in several threads (models side by side, a server's requests) count
# themselves here: the first turns it off, the last back to what the first found. Each saving and
# restoring it alone left it off for good in most runs of two threads taking one-row products at
# once (A saves on, turns off; B saves off; A restores on; B restores off), and every later bf16
# product of the process then took another kernel, with other bits (tests/test_kernel_determinism.py).
_onednn_lock = threading.Lock()
_onednn_off = 0        # one-row products in flight with oneDNN turned off
_onednn_was = True     # the switch as the first of them found it


def _mv_without_onednn(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch.mv(w, v) on the plain BLAS path (oneDNN off for the call; see `Kernels.linear`).
    torch.backends.mkldnn.flags() does the same but costs ~10 us and warns on every call. While
    it runs, another thread's bf16 products find oneDNN off too: the switch has no per-thread form."""
    global _onednn_off, _onednn_was
    with _onednn_lock:
        if _onednn_off == 0:
            _onednn_was = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)
        _onednn_off += 1
    try:
        return torch.mv(w, v)
    finally:
        with _onednn_lock:
            _onednn_off -= 1
            if _onednn_off == 0:
                torch._C._set_mkldnn_enabled(_onednn_was)


class Kernels:
    """The operations whose implementation a model's kernel choice decides. `native` is the
    compiled module behind them, or None."""

    name = ""
    native: ModuleType | None = None
    # Products with quantized weights of at most this many rows round their input to 8 bits
    # first and take the integer kernels (`select`); 0: none.
    act8_rows = 0
    # RMSNorms and GELU in ggml's arithmetic (`rms_norm_ggml`, `gelu_ggml`): set with llama.cpp's
    # numerics in fp32 (`--dtype float32 --activations q8`, `select`).
    ggml_norms = False

    _quant: ModuleType | None = None

    @property
    def act8(self) -> bool:
        return self.act8_rows > 0

    @property
    def quant(self) -> ModuleType:
        """The kernels over quantized blocks (`quant_native`), built when first needed."""
        if self._quant is None:
            from .quant_native import load_quant_native

            self._quant = load_quant_native()
        return self._quant

    @property
    def multiplies_blocks(self) -> bool:
        """Whether dense quantized matrices are best kept as blocks (`load_dense`): with 8-bit
        activations their integer products beat bf16 ones (tools/quant_gemv_probe.py); with exact
        ones a bf16 matrix dequantized at load streams faster than decoding blocks to fp32. A
        GGUF's F16 and BF16 matrices are then kept as its rows too, for ggml's fp16 or bf16
        rounding of their input."""
        return self.act8

    def holds_tiles(self, storage, shape: tuple[int, int]) -> bool:
        """Whether a quantized matrix is best held as tiles of eight rows (`quant.tile_rows`):
        where every product of it takes the integer kernels and its type's tiles take exactly its
        rows' bytes (`TILED_TYPES`). The same bits, read faster: with Q4_K_M experts so held,
        decode took 0.92x the time and a 512-token prompt ran 1.05-1.07x faster on AVX2, as a
        prompt's products no longer form them (docs/benchmarks.md, "Quantized experts held as
        tiles")."""
        return (self.act8_rows == ALL_ROWS and storage in TILED_TYPES and shape[0] % 8 == 0
                and self.quant.isa == "avx2")

    def tile_rows(self, raw: torch.Tensor, storage, cols: int) -> torch.Tensor:
        return self.quant.tile_rows(raw, int(storage), cols)

    def copy_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A slot fill from host memory (`layout.Tiler`)."""
        dst.copy_(src)

    def tiles(self, w: QuantTensor) -> QuantTensor:
        """`w` as tiles where `holds_tiles` says so, else `w`."""
        if not self.holds_tiles(w.qtype, w.shape):
            return w
        return QuantTensor(self.tile_rows(w.raw, w.qtype, w.shape[1]), w.qtype, w.shape, tiled=True)

    def embedding(self, tokens: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` [T] of an embedding table -> [T, D] in `dtype`; a quantized table's rows
        are decoded exactly (fp32, rounded once), as a table dequantized at load holds them."""
        if isinstance(table, QuantTensor):
            return self.dense(table.take(tokens), dtype)
        return F.embedding(tokens, table)

    def linear_blocks(self, x: torch.Tensor, w: QuantTensor | RowParts, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ w^T for w the file's blocks: one row straight from the blocks (native), more
        rows against the weights decoded a block of rows at a time (a bounded temporary). With
        up to `act8_rows` rows, the rows are rounded as llama.cpp rounds them and go through the
        integer kernels, each row as it would alone (beside F16 and BF16 rows, the input rounded
        to fp16 or bf16 and multiplied in fp32)."""
        if isinstance(w, RowParts):
            outs, start = [], 0
            for p in w.parts:
                end = start + p.shape[0]
                outs.append(self.linear(x, p, None if b is None else b[start:end]))
                start = end
            return torch.cat(outs, dim=-1)
        if w.qtype == Q.BF16 and x.dtype == torch.bfloat16:
            # ggml rounds the input to bf16 beside BF16 weights: a bf16 row is its own rounding, and
            # the file's rows are the bf16 matrix, multiplied as one dequantized at load was.
            return self.linear(x, w.raw.view(torch.bfloat16), b)
        T, (N, K) = x.shape[0], w.shape
        if w.tiled:  # only where every product takes the integer kernels (`tiles`)
            y = self.quant.gemm_tiles(w.raw, int(w.qtype), x, True)  # [T, N] in x's dtype
            return y if b is None else y + b
        if T == 1:
            y = self.quant.gemv(w.raw, int(w.qtype), x, self.act8, True)  # [1, N] in x's dtype
            return y if b is None else y + b
        if T <= self.act8_rows:  # the one-row kernels, several rows against each decoded block
            y = self.quant.gemm_act8(w.raw, int(w.qtype), x).to(x.dtype)  # [T, N]
            return y if b is None else y + b
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
        step = max(1, WIDE_BLOCK_BYTES // (4 * K))
        for a in range(0, N, step):
            e = min(a + step, N)
            out[:, a:e] = self.linear(x, self.dense(w.rows(a, e), x.dtype), None if b is None else b[a:e])
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ w[N, K]^T (+ b) -> [T, N].

        One row in bf16/fp16 on a CPU (every decode step) is a matrix-vector product, which is
        memory-bound: oneDNN's matmul reads the weights at well under half the machine's
        bandwidth there, while the plain BLAS path streams them at nearly full speed. The path
        depends only on the row count, never on cache state, so results stay identical across
        cache modes.
        """
        if isinstance(w, (QuantTensor, RowParts)):
            return self.linear_blocks(x, w, b)
        if x.shape[0] == 1 and x.dtype in _REDUCED and x.device.type == "cpu":
            y = _mv_without_onednn(w, x[0])             # [N]
            return (y if b is None else y + b)[None]    # [1, N]
        if x.shape[0] >= WIDE_ROWS and x.dtype in _REDUCED and x.device.type == "cpu" and not _has_gemm(x.dtype):
            return _linear_in_fp32(x, w, b)
        return F.linear(x, w, b)

    def activation(self, act: str):
        """The gated MLP's activation function for `act` (`ACTIVATIONS`), ggml's GELU with
        llama.cpp's numerics (`ggml_norms`)."""
        return gelu_ggml if self.ggml_norms and act == "gelu_pytorch_tanh" else ACTIVATIONS[act]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.ggml_norms:
            return rms_norm_ggml(x, weight, eps)
        # Normalise in fp32 and scale in the compute dtype, as the reference implementations do.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def rms_norm_scaled(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, reference) -> torch.Tensor:
        """An RMSNorm over the last dim normalised and scaled in fp32 and rounded once (Gemma 4's,
        Qwen3.5's), `weight` optional: `reference(x, weight, eps)`, the family's torch formula."""
        if self.ggml_norms:
            return rms_norm_ggml(x, weight, eps)
        return reference(x, weight, eps)

    def swiglu(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """down(act(gate(x)) * up(x)) with gate_up [2I, D] (gate rows, then up rows), down [D, I];
        `act` one of `ACTIVATIONS` (silu: SwiGLU, gelu_pytorch_tanh: GeGLU)."""
        I = down.shape[1]
        gu = self.linear(x, gate_up)                     # [T, 2I]
        # Two slices rather than chunk(): the same views, at a fraction of chunk's dispatch cost,
        # which counts 16 times a decode step at top-8.
        gate = F.silu(gu[:, :I]) if act == "silu" else self.activation(act)(gu[:, :I])
        return self.linear(gate * gu[:, I:], down)  # [T, D]

    def expert(self, x: torch.Tensor, w, act: str = "silu") -> torch.Tensor:
        """One routed expert (`tiers.layout.ExpertWeights`) on x [T, D] -> [T, D]. Quantized
        matrices are dequantized exactly (to fp32, then the compute dtype) before the product."""
        # A float expert, unless q8 rounds its input to the file's fp16/bf16 (`_expert_act8`).
        if (isinstance(w.gate_up, torch.Tensor) and isinstance(w.down, torch.Tensor)
                and (w.inputs is None or not self.act8)):
            return self.swiglu(x, w.gate_up, w.down, act)
        if x.shape[0] <= self.act8_rows:
            return self._expert_act8(x, w, act)
        if isinstance(w.gate_up, QuantTensor):  # one matrix of blocks (fused, or adjacent in one type)
            gate_up = self.dense(w.gate_up, x.dtype)                                   # [2I, D]
        else:  # decoded straight into the two halves of one matrix (no copy to join them)
            I = w.gate.shape[0]
            gate_up = torch.empty((2 * I, w.gate.shape[1]), dtype=x.dtype, device=x.device)
            self.dense_into(w.gate, gate_up[:I])
            self.dense_into(w.up, gate_up[I:])
        return self.swiglu(x, gate_up, self.dense(w.down, x.dtype), act)

    def _expert_act8(self, x: torch.Tensor, w, act: str) -> torch.Tensor:
        """A quantized expert with its activations rounded to 8 bits (llama.cpp's numerics) on any
        number of rows: the integer kernels of the native one-row call, row by row, the
        intermediate in fp32, so each row is what that call gives it. A float expert the file
        stores as fp16 or bf16, held widened to fp32 (`tiers.layout.ExpertWeights.inputs`), takes
        the same path: each product's input rounded to its matrix's file type, then multiplied
        in fp32 as ggml multiplies F16 and BF16 weights (their `vec_dot_type`), by the kernels
        that multiply such a matrix within a quantized expert."""
        def product(v: torch.Tensor, m) -> torch.Tensor:  # [T, N] fp32; tiles held in the slot give the same bits
            if isinstance(m, torch.Tensor):  # a float expert's fp32 matrix, as rows of ggml's F32
                return self.quant.gemm_act8(m.view(torch.uint8), int(Q.F32), v)
            if m.tiled:
                return self.quant.gemm_tiles(m.raw, int(m.qtype), v)
            return self.quant.gemm_act8(m.raw, int(m.qtype), v)

        g, u, d = w.inputs or (None, None, None)  # float matrices of the file's fp16/bf16 (`_rounded`)
        if w.gate_up is not None:  # one call: the rows rounded once, each output the same
            I = w.gate.shape[0]
            gu = product(_rounded(x, g), w.gate_up)                   # [T, 2I] fp32
            h = self.activation(act)(gu[:, :I]) * gu[:, I:]           # [T, I] fp32
        else:
            h = self.activation(act)(product(_rounded(x, g), w.gate)) * product(_rounded(x, u), w.up)  # [T, I] fp32
        return product(_rounded(h, d), w.down).to(x.dtype)           # [T, D]

    def dense(self, w, dtype: torch.dtype) -> torch.Tensor:
        """A weight as a float matrix in `dtype`: itself, or its blocks dequantized (exactly, in
        fp32, then rounded once to `dtype`)."""
        if isinstance(w, torch.Tensor):
            return w
        if w.tiled:  # only the integer kernels read tiles (`holds_tiles`)
            raise TypeError("Kernels.dense: the matrix is held as tiles, not the file's rows")
        from .dequant import dequantize

        return dequantize(w.raw, w.qtype, w.shape).to(dtype)

    def dense_into(self, w, out: torch.Tensor) -> None:
        """`dense(w, out.dtype)` written into `out` (a contiguous [rows, cols] tensor)."""
        out.copy_(self.dense(w, out.dtype))

    # Whether `experts_one_row` can write into rows of an `out` buffer, for `combine`.
    ranked_rows = False

    def experts_one_row(self, x: torch.Tensor, wave: list, act: str = "silu", out: torch.Tensor | None = None,
                        rows: list[int] | None = None) -> torch.Tensor | None:
        """A decode step's wave of experts [(id, ExpertWeights)] in one call, [n, D]; None when
        this kernel set has no such call for `act` (each expert then runs through `swiglu`).
        With `out` (fp32 [A, D]), expert j's output goes unrounded to row rows[j] of it instead
        (`ranked_rows`), and `out` is returned."""
        return None

    def combine(self, weights: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A decode step's MoE output from `experts_one_row`'s rows, [1, D] in x's dtype: the sum
        over ranks of weights[0, a] * rows[a], in rank order, in fp32, each product rounded before
        it is added (llama.cpp's multiply, then its chain of adds), the sum rounded once."""
        w = weights.reshape(-1).float()
        y = torch.zeros_like(rows[0])
        for a in range(rows.shape[0]):
            y = y + w[a] * rows[a]
        return y[None].to(x.dtype)

    def route(self, x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
              weights_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of x [T, D]: softmax over the router's logits in fp32, the k largest,
        renormalised when `normalize`, in the logits' dtype unless `weights_fp32`:
        (weights [T, k], expert ids [T, k])."""
        logits = self.linear(x, router)                           # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
        w, ids = torch.topk(probs, top_k, dim=-1)                 # [T, k]
        if normalize:
            w = w / w.sum(dim=-1, keepdim=True)
        if not weights_fp32:
            w = w.to(logits.dtype)
        return w, ids


class TorchKernels(Kernels):
    name = "torch"


class NativeKernels(Kernels):
    """The native one-row paths, and on AVX2 bf16 products of fewer than `NATIVE_ROWS` rows;
    everything else stays on torch's."""

    name = "native"

    def __init__(self, module: ModuleType):
        self.native = module

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        # A native model is bf16 on the CPU (`check_choice`), so one row is the native product.
        if isinstance(w, (QuantTensor, RowParts)):
            return self.linear_blocks(x, w, b)
        T = x.shape[0]
        if T == 1 and w.is_contiguous():
            y = self.native.gemv(w, x)                  # [1, N]
            return y if b is None else y + b
        if T < NATIVE_ROWS and b is None and self.native.isa == "avx2" and w.is_contiguous() and x.is_contiguous():
            return self.native.linear_rows(x, w)        # [T, N]
        return super().linear(x, w, b)

    def copy_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Streaming stores: a decode step's fills in 0.7 of copy_'s time (docs/benchmarks.md).
        self.native.copy_bytes(dst, src)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape  # a Python tuple: read without a dispatch, unlike x.dim()
        if len(shape) == 2 and shape[0] == 1:
            return self.native.rms_norm(x, weight, eps)  # one call for torch's eight
        return super().rms_norm(x, weight, eps)

    def rms_norm_scaled(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, reference) -> torch.Tensor:
        # A decode step's norms (one token: [1, D], or [1, heads, Dh]) in one call each.
        if x.shape[0] == 1 and x.dtype == torch.bfloat16:
            return self.native.rms_norm_scaled(x, weight, eps)
        return reference(x, weight, eps)

    def dense(self, w, dtype: torch.dtype) -> torch.Tensor:
        # The native decoder writes the rounded values straight into the output, rows across
        # threads: the same bits as torch's dequantize-then-cast, several times faster.
        if isinstance(w, torch.Tensor) or dtype not in _DECODED:
            return super().dense(w, dtype)
        out = torch.empty(w.shape, dtype=dtype)
        self.dense_into(w, out)
        return out

    def dense_into(self, w, out: torch.Tensor) -> None:
        if isinstance(w, torch.Tensor) or out.dtype not in _DECODED:
            return super().dense_into(w, out)
        self.quant.dequantize_into(w.raw, int(w.qtype), out)

    ranked_rows = True

    def experts_one_row(self, x: torch.Tensor, wave: list, act: str = "silu", out: torch.Tensor | None = None,
                        rows: list[int] | None = None) -> torch.Tensor | None:
        if act not in NATIVE_ACTIVATIONS:
            return None
        first = wave[0][1] if wave else None
        if first is not None and not isinstance(first.down, torch.Tensor):
            # Quantized experts: products straight from the blocks, the wave in one call. All
            # experts of a layer share one format, so the wave's types are the first's; a float
            # matrix among the blocks comes as rows of ggml's F32/F16/BF16 (`tiers.layout`).
            return self.quant.experts(x, [w.gate.raw for _, w in wave], [w.up.raw for _, w in wave],
                                      [w.down.raw for _, w in wave], int(first.gate.qtype), int(first.up.qtype),
                                      int(first.down.qtype), act, self.act8, True, out, rows or [],
                                      [first.gate.tiled, first.up.tiled, first.down.tiled])
        if not all(isinstance(w.gate_up, torch.Tensor) for _, w in wave):
            return None
        # Each expert's row is what it would be alone. Slot views are contiguous [2I, D] and
        # [D, I] in the model's dtype (bf16), which the native call requires.
        return self.native.experts(x[0].contiguous(), [w.gate_up for _, w in wave], [w.down for _, w in wave], act,
                                   out, rows or [])

    def combine(self, weights: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.native.combine(weights, rows, x)

    def route(self, x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
              weights_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # One token against a bf16 router: the whole routing in one call (its logits are
        # `linear`'s, bit for bit).
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and isinstance(router, torch.Tensor) \
                and router.dtype == torch.bfloat16 and router.is_contiguous():
            return self.native.route(x, router, top_k, normalize, weights_fp32)
        return super().route(x, router, top_k, normalize, weights_fp32)

