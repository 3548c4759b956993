"""Assembling a model from a checkpoint: the architecture's data says which tensors to expect
and where the experts are; the format reader (`checkpoint/`) only yields named tensors.

`open_model` reads and validates a checkpoint without loading weights; `load_dense` reads the
weights that stay in the fast tier; `HFExperts` describes the experts as bytes for the tiers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint.safetensors_io import DTYPE_CODES, Checkpoint, Segment, TensorInfo
from ..checkpoint.storage import QuantTensor, RowParts
from ..config import ModelConfig, RopeOverride
from ..errors import ExpertCacheError
from ..memory import host_copy
from ..tiers.layout import ExpertFormat, Weight
from . import for_model_type
from .arch import IGNORED_SUFFIXES, PACKED_LAYOUT, Architecture, ExpertLayout
from .decoder import DenseWeights, LayerWeights
from .gated_attention import unit_offset
from .layers import MLPWeights
from .mixers import Reader


def read_config(directory: str | Path) -> tuple[ModelConfig, type[Architecture], dict]:
    d = Path(directory)
    if not d.exists():  # -m takes a directory or a GGUF file: "model path", not "model directory"
        raise ExpertCacheError(f"model path {str(d)!r} does not exist: expected a Hugging Face model directory "
                               "or a .gguf file")
    if not d.is_dir():
        raise ExpertCacheError(f"model path {str(d)!r} is neither a directory nor a GGUF file: expected a "
                               "Hugging Face model directory or a .gguf file")
    path = d / "config.json"
    if not path.exists():
        raise ExpertCacheError(f"{path}: missing (a model directory needs config.json)")
    try:
        data = path.read_bytes()
    except OSError as e:  # the file system's refusal (permissions, I/O), not the file's content
        raise ExpertCacheError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExpertCacheError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ExpertCacheError(f"{path}: expected a JSON object")
    arch = for_model_type(raw.get("model_type"), str(path))
    return arch.config_from_hf(raw, str(path)), arch, raw


class HFExperts:
    """A safetensors checkpoint's experts as bytes (`tiers.store.ExpertSource`).

    An expert is gate [I, D], up [I, D], down [D, I] (or the fused gate_up [2I, D] and down), in
    that order; a packed checkpoint holds each expert as one range of the same bytes.
    """

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layout: ExpertLayout, prefix: str):
        self.ckpt, self.cfg, self.layout, self.prefix = ckpt, cfg, layout, prefix
        self.files = ckpt.files
        self.layers = cfg.moe_layers
        self.num_experts = cfg.num_experts
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.dtype = self._tensor(self.layers[0], "down", 0).dtype
        if layout.gate_up:
            parts = [("gate_up", self.dtype, (2 * I, D)), ("down", self.dtype, (D, I))]
        else:
            parts = [("gate", self.dtype, (I, D)), ("up", self.dtype, (I, D)), ("down", self.dtype, (D, I))]
        self._format = ExpertFormat.of(parts)

    def _name(self, layer: int, part: str, e: int) -> str:
        return self.prefix.format(i=layer) + getattr(self.layout, part).format(e=e)

    def _tensor(self, layer: int, part: str, e: int) -> TensorInfo:
        part = "packed" if self.layout.packed else part
        return self.ckpt.info(self._name(layer, part, e))

    def format(self, layer: int) -> ExpertFormat:
        return self._format

    def segments(self, layer: int, e: int) -> list[Segment]:
        L = self.layout
        parts = ("packed",) if L.packed else ("gate", "up", "down") if L.gate else ("gate_up", "down")
        out = []
        for p in parts:
            info = self._tensor(layer, p, e)
            if L.gate:
                out.append(Segment(info.file, info.offset, info.nbytes))
            else:
                row = info.nbytes // info.shape[0]
                out.append(Segment(info.file, info.offset + e * row, row))
        return out

    def run_parts(self, layer: int, first: int, n: int) -> list[tuple[Segment, int, int]] | None:
        if not self.layout.packed:
            return None
        a = self.segments(layer, first)[0]
        return [(Segment(a.file, a.offset, a.nbytes * n), 0, a.nbytes)]

    def read(self, layer: int, e: int) -> torch.Tensor:
        L = self.layout
        if L.packed:
            return self.ckpt.read_rows(self._name(layer, "packed", e), e).reshape(-1).view(torch.uint8)
        if L.gate:
            parts = [self.ckpt.read(self._name(layer, p, e)) for p in ("gate", "up", "down")]
        else:
            parts = [self.ckpt.read_rows(self._name(layer, p, e), e) for p in ("gate_up", "down")]
        return torch.cat([p.reshape(-1) for p in parts]).view(torch.uint8)


@dataclass(slots=True)
class OpenedModel:
    """A validated checkpoint, nothing loaded yet."""

    path: Path
    cfg: ModelConfig
    arch: type[Architecture]
    ckpt: Checkpoint
    layout: ExpertLayout
    experts: HFExperts


def _detect_layout(ckpt: Checkpoint, cfg: ModelConfig, arch: type[Architecture]) -> ExpertLayout:
    prefix = arch.names(cfg)["layer"].format(i=cfg.moe_layers[0])
    for layout in (*arch.expert_layouts, PACKED_LAYOUT):
        probe = layout.packed or layout.gate_up or layout.gate.format(e=0)
        if prefix + probe in ckpt:
            return layout
    first = arch.expert_layouts[0]
    raise ExpertCacheError(f"{ckpt.dir}: missing tensor '{prefix}{first.gate.format(e=0)}' "
                           f"(no expert weights found in any known layout for {cfg.model_type})")


def expected_shapes(cfg: ModelConfig, arch: type[Architecture], layout: ExpertLayout,
                    packed_dtype: torch.dtype | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape (a packed layout's experts are
    [E, elements of `packed_dtype`])."""
    N = arch.names(cfg)
    D, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {N["embed"]: (V, D), N["norm"]: (D,)}
    if not cfg.tie_word_embeddings:
        out[N["lm_head"]] = (V, D)

    def mlp(prefix: str, width: int) -> None:
        out.update({prefix + "gate_proj.weight": (width, D), prefix + "up_proj.weight": (width, D),
                    prefix + "down_proj.weight": (D, width)})

    block = arch.block(cfg)
    for i, mixer in enumerate(arch.mixers(cfg)):
        p = N["layer"].format(i=i)
        out[p + N["input_norm"]] = (D,)
        out[p + N["post_norm"]] = (D,)
        out.update(mixer.shapes(p))
        if block is not None:
            out.update(block.shapes(p))
        if not cfg.sparse_layers[i]:
            mlp(p + N["mlp"], cfg.intermediate_size)
            continue
        out[p + layout.router] = (E, D)
        if layout.packed:
            out[p + layout.packed] = (E, 3 * I * D)
        elif layout.gate:
            for e in range(E):
                out[p + layout.gate.format(e=e)] = (I, D)
                out[p + layout.up.format(e=e)] = (I, D)
                out[p + layout.down.format(e=e)] = (D, I)
        else:
            out[p + layout.gate_up] = (E, 2 * I, D)
            out[p + layout.down] = (E, D, I)
        if cfg.shared_expert_intermediate_size:
            mlp(p + N["shared"], cfg.shared_expert_intermediate_size)
            out[p + N["shared_gate"]] = (1, D)
    return out


def optional_shapes(cfg: ModelConfig, arch: type[Architecture]) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may hold or leave out (a block's defaults then apply), with shapes."""
    N = arch.names(cfg)
    out = {}
    if arch.shared_expert_width is not None and not cfg.shared_expert_intermediate_size:
        # transformers builds a shared expert of width 0 and its gate where the config says 0, and
        # saves their empty tensors: the expert adds exactly nothing, so they are not read.
        D = cfg.hidden_size
        for i in cfg.moe_layers:
            p = N["layer"].format(i=i) + N["shared"]
            out.update({p + "gate_proj.weight": (0, D), p + "up_proj.weight": (0, D), p + "down_proj.weight": (D, 0),
                        N["layer"].format(i=i) + N["shared_gate"]: (1, D)})
    block = arch.block(cfg)
    if block is not None:
        out.update({n: s for i in range(cfg.num_layers) for n, s in block.optional(N["layer"].format(i=i)).items()})
    return out


def _check_dtypes(ckpt: Checkpoint, expected: dict[str, tuple[int, ...]], layout: ExpertLayout) -> None:
    """Weights are floats, and every expert tensor has one dtype: the tiers size each slot from the
    first expert's dtype and copy an expert's bytes as they are, so an expert stored otherwise
    would be read as the wrong numbers, not refused. (A packed layout's bytes are uint8.)"""
    marks = [m.split("{e}")[0] for m in (layout.gate, layout.up, layout.down, layout.gate_up) if m]
    expert_dtype = None
    for name in expected:
        info = ckpt.info(name)
        if layout.packed and name.endswith(layout.packed):
            continue
        if not info.dtype.is_floating_point:
            raise ExpertCacheError(f"{info.file}: tensor {name!r} has dtype {DTYPE_CODES[info.dtype]}, "
                                   "expected a float dtype (F32, F16, BF16)")
        if any(m in name for m in marks):
            expert_dtype = expert_dtype or (name, info.dtype)
            if info.dtype != expert_dtype[1]:
                raise ExpertCacheError(f"{info.file}: tensor {name!r} has dtype {DTYPE_CODES[info.dtype]}, "
                                       f"expected {DTYPE_CODES[expert_dtype[1]]} as {expert_dtype[0]!r} "
                                       "(every expert tensor in one dtype)")


def open_model(path: str | Path, rope: RopeOverride | None = None) -> OpenedModel:
    """Read and validate a checkpoint directory or a GGUF file; nothing is loaded into memory yet.
    `rope`: a RoPE scaling over the checkpoint's own (`--rope-scaling`, ...)."""
    m = _open_model(Path(path))
    if rope is not None and not rope.empty:
        # Gemma 4's layers build their tables from their own keys: the config's RoPE is read by none.
        if not any(mixer.rotary_dim is not None for mixer in m.arch.mixers(m.cfg)):
            raise ExpertCacheError(f"{rope.given()}: RoPE scaling is not supported for {m.cfg.model_type}, whose "
                                   "layers build their own RoPE tables")
        m.cfg = replace(m.cfg, rope=rope.apply(m.cfg.rope, m.cfg.max_position))
    return m


def _open_model(path: Path) -> OpenedModel:
    from .gguf_loader import is_gguf, open_gguf  # it builds on this module

    if is_gguf(path):
        return open_gguf(path)
    cfg, arch, _ = read_config(path)
    ckpt = Checkpoint(path)
    layout = _detect_layout(ckpt, cfg, arch)
    expected = expected_shapes(cfg, arch, layout)
    for name, shape in expected.items():
        if name not in ckpt:
            raise ExpertCacheError(f"{ckpt.dir}: missing tensor {name!r} (expected shape {list(shape)})")
        got = ckpt.info(name).shape
        if got != shape:
            raise ExpertCacheError(f"{ckpt.info(name).file}: tensor {name!r} has shape {list(got)}, "
                                   f"expected {list(shape)}")
    _check_dtypes(ckpt, expected, layout)
    optional = optional_shapes(cfg, arch)
    for name, shape in optional.items():
        if name in ckpt and ckpt.info(name).shape != shape:
            raise ExpertCacheError(f"{ckpt.info(name).file}: tensor {name!r} has shape {list(ckpt.info(name).shape)}, "
                                   f"expected {list(shape)}")
    skipped = 0
    for name in ckpt.tensors:
        if name in expected or name in optional or name.endswith(IGNORED_SUFFIXES):
            continue
        if name.startswith(arch.skipped_prefixes):
            skipped += 1
            continue
        if name == arch.names(cfg)["lm_head"] and cfg.tie_word_embeddings:
            continue
        raise ExpertCacheError(f"{ckpt.info(name).file}: unexpected tensor {name!r} for {cfg.model_type}")
    if skipped:
        print(f"expertcache: {path}: skipping {skipped} tensors this engine does not run "
              f"({', '.join(p + '*' for p in arch.skipped_prefixes)})", file=sys.stderr)
    experts = HFExperts(ckpt, cfg, layout, arch.names(cfg)["layer"])
    return OpenedModel(path, cfg, arch, ckpt, layout, experts)


def load_dense(m: OpenedModel, device: torch.device, dtype: torch.dtype, blocks: bool = False,
               tiles: Callable[[QuantTensor], QuantTensor] | None = None) -> DenseWeights:
    """Embedding, final norm, LM head and every layer's dense weights, in `dtype` on `device`.
    `blocks`: the kernels multiply quantized blocks, so a GGUF's quantized matrices stay as the
    file's blocks (`GGUFDense.matrix`) where the converter left them so."""
    ckpt, cfg, N = m.ckpt, m.cfg, m.arch.names(m.cfg)

    def read(name: str) -> torch.Tensor:
        return ckpt.read(name).to(device=device, dtype=dtype)

    def get(name: str) -> torch.Tensor:
        # Weights every step reads go to huge-page memory; fused ones are joined first.
        return host_copy(read(name))

    def blocks_of(q: QuantTensor, tile: bool) -> QuantTensor:
        if tile and tiles is not None and (t := tiles(q)) is not q:
            return QuantTensor(host_copy(t.raw), t.qtype, t.shape, tiled=True)
        return QuantTensor(host_copy(q.raw), q.qtype, q.shape)

    def matrices(names: list[str], tile: bool = True) -> Weight:
        """Matrices multiplied as one (their rows joined): the file's blocks where they all stay
        blocks of one type, floats where none does, else each part as it stays (`RowParts`).
        Blocks only ever multiplied are interleaved for the kernels where `tiles` says so; an
        embedding table (`tile=False`) keeps the file's rows, which a lookup reads one by one."""
        if blocks and hasattr(ckpt, "matrix"):
            parts = [ckpt.matrix(n) for n in names]
            if all(p is None for p in parts):
                return host_copy(torch.cat([read(n) for n in names]))
            if all(p is not None for p in parts) and (joined := QuantTensor.cat(parts)) is not None:
                return blocks_of(joined, tile)
            kept = tuple(get(n) if p is None else blocks_of(p, tile) for n, p in zip(names, parts))
            return RowParts(kept, (sum(p.shape[0] for p in kept), kept[0].shape[1]))
        return host_copy(torch.cat([read(n) for n in names]))

    def norm(name: str) -> torch.Tensor:
        return unit_offset(read(name)) if m.arch.unit_offset_norms else get(name)

    def mlp(prefix: str) -> MLPWeights:
        return MLPWeights(matrices([prefix + "gate_proj.weight", prefix + "up_proj.weight"]),
                          matrices([prefix + "down_proj.weight"]))

    reader = Reader(read, host_copy, lambda name: name in ckpt, matrices)
    embed = matrices([N["embed"]], tile=False)
    lm_head = embed if cfg.tie_word_embeddings else matrices([N["lm_head"]])
    layers = []
    block = m.arch.block(cfg)
    for i, mixer in enumerate(m.arch.mixers(cfg)):
        p = N["layer"].format(i=i)
        lw = LayerWeights(norm(p + N["input_norm"]), norm(p + N["post_norm"]), mixer.load(p, reader), mixer)
        if cfg.sparse_layers[i]:
            lw.router = get(p + m.layout.router)
            if cfg.shared_expert_intermediate_size:
                lw.shared = mlp(p + N["shared"])
                lw.shared_gate = get(p + N["shared_gate"])
        else:
            lw.dense = mlp(p + N["mlp"])
        if block is not None:
            lw.block, lw.block_w = block, block.load(p, reader)
            lw.dense = lw.block_w.dense  # so that what counts the fast tier's weights sees it
        layers.append(lw)
    return DenseWeights(embed, norm(N["norm"]), lm_head, layers, m.arch.unit_offset_norms,
                        **m.arch.dense_options(cfg))
