"""Dequantization of ggml block formats (GGUF tensors) in torch, bit-identical to gguf-py.

`dequantize(raw, qtype, shape)` turns the raw bytes of a GGUF tensor into float32 that equals
`gguf.quants.dequantize` bit for bit, for every type in `SUPPORTED`. It runs on whatever device
`raw` lives on (pure torch ops, no loop over blocks in Python).

Bit-identity holds because every float step is the one gguf-py takes, in float32 and in the same
order: fp16 scales widened to float32, the super-block scale times the sub-block scale rounded to
float32 first, then times the quant, then the minimum subtracted (two roundings, never a fused
multiply-add). Integer quants are small enough to be exact in float32 however they are formed.

On the CPU it works in chunks of CPU_CHUNK weights, so that the float32 intermediates stay in
the core's cache; it is a few dozen small torch ops per chunk, which makes it the portable path
(CUDA, or a CPU without the native module) more than the fast one: on the CPU the native
module's `dequantize_into` (kernels/quant_native.py) decodes the same bits several times faster.

Shapes are torch's: the last dimension is a row, ggml's ne[0], and must be a whole number of
blocks. B = blocks, S = weights per block, Z = bytes per block.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ..errors import ExpertCacheError

QK_K = 256
# IQ4_NL's and IQ4_XS's non-linear 4-bit code book (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Weights per chunk on the CPU: a chunk's float32 intermediates stay in the core's cache.
CPU_CHUNK = 1 << 17


def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., n] bytes as [..., n / size] `dtype` elements holding the same bytes (a view when the
    bytes are aligned for it, else a copy)."""
    try:
        return b.view(dtype)
    except RuntimeError:  # a slice at an offset that is not a multiple of the element size
        return torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b).view(dtype)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, widened: [B, 1] float32."""
    return _view(blocks[:, at:at + 2], torch.float16).float()


def _words(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes (n a multiple of 4) as [..., n / 4] int32 words holding the same bytes.

    Bit fields are cut out of words, four bytes per op: torch's byte-wise shifts are slow."""
    return _view(b, torch.int32)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: the low nibbles of all n bytes, then the high ones."""
    w = _words(b)
    return torch.stack((w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F), dim=-2).view(torch.uint8)


def _bits(b: torch.Tensor, count: int, width: int, device: torch.device) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field i is (b >> i*width) & mask, fields in order.

    Within a word a field never crosses into the next byte (i*width + width <= 8), and the mask
    keeps each byte's own bits, so shifting whole words is the same as shifting bytes."""
    shifts = torch.arange(0, count * width, width, dtype=torch.int32, device=device)
    mask = ((1 << width) - 1) * 0x01010101
    return ((_words(b).unsqueeze(-2) >> shifts[:, None]) & mask).view(torch.uint8)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)                                                           # [B, 1]
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).float() - 8                   # [B, 32]
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).float()
    return d * q + m


def _q5_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit quants of 32-weight blocks: bit 4 of weight i is bit i of the little-endian qh."""
    high = _bits(qh, 8, 1, qh.device).transpose(-1, -2).reshape(len(qh), 32)  # [B, 32] weight order
    return _nibbles(qs).reshape(len(qs), 32) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * (_q5_bits(b[:, 2:6], b[:, 6:]).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _q5_bits(b[:, 4:8], b[:, 8:]).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0x0F).float())[..., None]                                # [B, 16, 1]
    ml = (dmin * (sc >> 4).float())[..., None]
    q = _bits(qs.reshape(n, 2, 32), 4, 2, b.device).reshape(n, 16, 16).float()  # [B, 16, 16]
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = _nibbles(sc[:, :8]).reshape(n, 16)
    high = _bits(sc[:, 8:], 4, 2, b.device).reshape(n, 16)
    scale = (low | (high << 4)).float() - 32                                 # [B, 16]
    dl = (d * scale)[..., None]                                              # [B, 16, 1]
    ql = _bits(qs.reshape(n, 2, 32), 4, 2, b.device).reshape(n, 16, 16)
    qh = _bits(hmask, 8, 1, b.device).reshape(n, 16, 16)
    # A clear high bit means minus 4: ql - 4 * (1 - bit).
    q = ql.float() - ((qh ^ 1) << 2).float()
    return (dl * q).reshape(n, QK_K)


def _k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit scales, then eight 6-bit minimums: [B, 2, 8].

    Worked on as three little-endian 32-bit words, four 6-bit fields at a time: a handful of
    ops per block instead of a dozen on byte slices."""
    w = _words(sc)                                                           # [B, 3]
    d, m, md = w[:, 0], w[:, 1], w[:, 2]
    fields = torch.stack((d & 0x3F3F3F3F, (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030),
                          m & 0x3F3F3F3F, ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)), dim=1)
    return fields.view(torch.uint8).view(-1, 2, 8)


def _k_rows(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's per-sub-block scale and minimum, each rounded to float32: [B, 8, 1] each."""
    dm = _view(b[:, :4], torch.float16).float()                              # [B, 2]: d, dmin
    both = dm[:, :, None] * _k_scales(b[:, 4:16]).float()                    # [B, 2, 8]
    return both[:, 0, :, None], both[:, 1, :, None]


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    dl, ml = _k_rows(b)                                                      # [B, 8, 1]
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()      # [B, 8, 32]
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    dl, ml = _k_rows(b)
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 8, 1, b.device)                                  # [B, 8, 32]
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    dl = (d * sc.view(torch.int8).float())[..., None]                        # [B, 16, 1]
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), 4, 2, b.device).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).float() - 32
    return (dl * q).reshape(n, QK_K)


_IQ4_TABLES: dict[torch.device, torch.Tensor] = {}


def _iq4_table(device: torch.device) -> torch.Tensor:
    # Made once per device: made per call, it is a copy from the host that a GPU waits for.
    table = _IQ4_TABLES.get(device)
    if table is None:
        table = _IQ4_TABLES[device] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)
    return table


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    idx = _nibbles(b[:, 2:]).reshape(len(b), 32).long()
    return d * _iq4_table(b.device)[idx]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    d = _f16(b, 0)
    sh = b[:, 2].int() | (b[:, 3].int() << 8)                                # [B] 16 bits
    high = (sh[:, None] >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 3  # [B, 8]
    low = _nibbles(b[:, 4:8]).transpose(-1, -2).reshape(n, 8)                # [B, 8] in sub-block order
    scale = (low.int() | (high << 4)).float() - 32
    dl = (d * scale)[..., None]                                              # [B, 8, 1]
    idx = _nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32).long()
    return (dl * _iq4_table(b.device)[idx]).reshape(n, QK_K)


# Float storage goes through `_view` too: raw bytes at an offset that is not a multiple of the
# element size (a slice of a larger byte buffer) cannot be viewed as floats where they lie, and
# the quantized types' fp16 fields are read that way already.
def _f32(b: torch.Tensor) -> torch.Tensor:
    return _view(b.contiguous(), torch.float32)


def _f16s(b: torch.Tensor) -> torch.Tensor:
    return _view(b.contiguous(), torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return _view(b.contiguous(), torch.bfloat16).float()


# blocks [B, Z] uint8 -> weights [B, S] float32, per storage type.
_BLOCKS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32, Q.F16: _f16s, Q.BF16: _bf16,
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}
SUPPORTED: tuple[Q, ...] = tuple(_BLOCKS)


def qtype_of(qtype: int | Q) -> Q:
    """The supported storage type `qtype` names; ExpertCacheError for any other."""
    try:
        t = Q(int(qtype))
    except ValueError:
        t = None
    if t not in _BLOCKS:
        name = t.name if t is not None else str(qtype)
        raise ExpertCacheError(f"GGUF storage type {name} is not supported; expected one of "
                               f"{', '.join(s.name for s in SUPPORTED)}")
    return t


def row_bytes(qtype: int | Q, n: int) -> int:
    """Bytes of a row of `n` weights of storage type `qtype` (`n` a whole number of blocks)."""
    t = qtype_of(qtype)
    size, nbytes = GGML_QUANT_SIZES[t]
    if n % size:
        raise ExpertCacheError(f"a row of {n} weights is not a whole number of {t.name} blocks; "
                               f"expected a multiple of {size}")
    return n // size * nbytes


def _blocks(raw: torch.Tensor, t: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """raw checked against `shape` and viewed as blocks: [B, Z] uint8."""
    if raw.dtype != torch.uint8:
        raise ExpertCacheError(f"{t.name} raw bytes have dtype {raw.dtype}; expected torch.uint8")
    if not shape:
        raise ExpertCacheError(f"{t.name} tensor shape is empty; expected at least one dimension")
    rows = 1
    for s in shape[:-1]:
        rows *= s
    need = rows * row_bytes(t, shape[-1])
    if raw.numel() != need:
        raise ExpertCacheError(f"{t.name} tensor of shape {tuple(shape)} takes {need} bytes; "
                               f"got {raw.numel()}")
    return raw.reshape(-1, GGML_QUANT_SIZES[t][1])


def _chunk_blocks(t: Q, device: torch.device, blocks: int) -> int:
    if device.type != "cpu":
        return max(blocks, 1)
    return max(CPU_CHUNK // GGML_QUANT_SIZES[t][0], 1)


def dequantize(raw: torch.Tensor, qtype: int | Q, shape: tuple[int, ...]) -> torch.Tensor:
    """raw bytes of a tensor of `shape` and storage type `qtype` -> float32 `shape`, on raw's
    device; bit-identical to `gguf.quants.dequantize`. Never aliases raw."""
    out = torch.empty(tuple(shape), dtype=torch.float32, device=raw.device)
    return dequantize_into(raw, qtype, shape, out)


def dequantize_into(raw: torch.Tensor, qtype: int | Q, shape: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
    """`dequantize` written into `out` (any floating dtype, on raw's device, contiguous, of
    `shape`): float32 values rounded once to out's dtype. Returns out."""
    t = qtype_of(qtype)
    blocks = _blocks(raw, t, tuple(shape))
    if tuple(out.shape) != tuple(shape) or not out.is_floating_point() or not out.is_contiguous():
        raise ExpertCacheError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected a "
                               f"contiguous floating tensor of shape {tuple(shape)}")
    if out.device != raw.device:
        raise ExpertCacheError(f"out is on {out.device}; expected {raw.device}, where raw is")
    fn, size = _BLOCKS[t], GGML_QUANT_SIZES[t][0]
    flat = out.view(-1, size)                                                # [B, S]
    step = _chunk_blocks(t, raw.device, len(blocks))
    for start in range(0, len(blocks), step):
        flat[start:start + step].copy_(fn(blocks[start:start + step]))
    return out
