"""Reading a Hugging Face MoE checkpoint directory: config, the expected tensor names from the
architecture's tables, validation (missing, unexpected, shapes), dense weights, and an
`ExpertSource` that reads one expert's matrices as one flat range.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import ExpertCacheError
from ..memory import host_copy
from ..models import ARCHITECTURES
from ..models.base import PACKED_LAYOUT, ExpertLayout, LayerWeights, MoEArch
from ..models.layers import AttentionWeights, MLPWeights
from .safetensors_io import Checkpoint, Segment, TensorInfo


def read_config(directory: str | Path) -> tuple[ModelConfig, dict]:
    d = Path(directory)
    if not d.exists():
        raise ExpertCacheError(f"model directory {str(d)!r} does not exist")
    if not d.is_dir():
        raise ExpertCacheError(f"model path {str(d)!r} is not a directory")
    path = d / "config.json"
    if not path.exists():
        raise ExpertCacheError(f"{path}: missing (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExpertCacheError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ExpertCacheError(f"{path}: expected a JSON object")
    return ModelConfig.from_hf(raw, str(path)), raw


class ExpertSource:
    """The checkpoint's experts: which bytes make up expert (layer, e), and reading them.

    An expert is gate [I, D], up [I, D], down [D, I], in that order, flattened.
    """

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, layout: ExpertLayout):
        self.ckpt, self.cfg, self.layout = ckpt, cfg, layout
        self.numel = cfg.expert_numel
        self.dtype = self._tensor(cfg.moe_layers[0], "down", 0).dtype

    def _name(self, layer: int, part: str, e: int) -> str:
        return f"model.layers.{layer}." + getattr(self.layout, part).format(e=e)

    def _tensor(self, layer: int, part: str, e: int) -> TensorInfo:
        part = "packed" if self.layout.packed else part
        return self.ckpt.info(self._name(layer, part, e))

    def segments(self, layer: int, e: int) -> list[Segment]:
        L = self.layout
        if L.packed:
            info = self._tensor(layer, "packed", e)
            row = info.nbytes // info.shape[0]
            return [Segment(info.file, info.offset + e * row, row)]
        parts = ("gate", "up", "down") if L.gate else ("gate_up", "down")
        out = []
        for p in parts:
            info = self._tensor(layer, p, e)
            if L.gate:
                out.append(Segment(info.file, info.offset, info.nbytes))
            else:
                row = info.nbytes // info.shape[0]
                out.append(Segment(info.file, info.offset + e * row, row))
        return out

    def read(self, layer: int, e: int) -> torch.Tensor:
        """Expert (layer, e) as a flat tensor [numel] in the checkpoint's dtype."""
        L = self.layout
        if L.packed:
            return self.ckpt.read_rows(self._name(layer, "packed", e), e)
        if L.gate:
            parts = [self.ckpt.read(self._name(layer, p, e)) for p in ("gate", "up", "down")]
        else:
            parts = [self.ckpt.read_rows(self._name(layer, p, e), e) for p in ("gate_up", "down")]
        return torch.cat([p.reshape(-1) for p in parts])

    @property
    def expert_nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _detect_layout(ckpt: Checkpoint, cfg: ModelConfig, arch: type[MoEArch]) -> ExpertLayout:
    layer = cfg.moe_layers[0]
    for layout in (*arch.expert_layouts, PACKED_LAYOUT):
        probe = layout.packed or layout.gate_up or layout.gate.format(e=0)
        if f"model.layers.{layer}.{probe}" in ckpt:
            return layout
    first = arch.expert_layouts[0]
    raise ExpertCacheError(f"{ckpt.dir}: missing tensor 'model.layers.{layer}.{first.gate.format(e=0)}' "
                           f"(no expert weights found in any known layout for {cfg.model_type})")


def expected_shapes(cfg: ModelConfig, layout: ExpertLayout) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    D, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        for n, shape in (("q", (qd, D)), ("k", (kd, D)), ("v", (kd, D)), ("o", (D, qd))):
            out[p + f"self_attn.{n}_proj.weight"] = shape
        if cfg.qkv_bias:
            for n, d in (("q", qd), ("k", kd), ("v", kd)):
                out[p + f"self_attn.{n}_proj.bias"] = (d,)
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm != "none":
            head = cfg.qk_norm == "head"
            out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,) if head else (qd,)
            out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,) if head else (kd,)
        if not cfg.sparse_layers[i]:
            Id = cfg.intermediate_size
            out.update({p + "mlp.gate_proj.weight": (Id, D), p + "mlp.up_proj.weight": (Id, D),
                        p + "mlp.down_proj.weight": (D, Id)})
            continue
        out[p + layout.router] = (E, D)
        if layout.packed:
            out[p + layout.packed] = (E, cfg.expert_numel)
        elif layout.gate:
            for e in range(E):
                out[p + layout.gate.format(e=e)] = (I, D)
                out[p + layout.up.format(e=e)] = (I, D)
                out[p + layout.down.format(e=e)] = (D, I)
        else:
            out[p + layout.gate_up] = (E, 2 * I, D)
            out[p + layout.down] = (E, D, I)
        if cfg.shared_expert_intermediate_size:
            Is = cfg.shared_expert_intermediate_size
            out.update({p + "mlp.shared_expert.gate_proj.weight": (Is, D), p + "mlp.shared_expert.up_proj.weight": (Is, D),
                        p + "mlp.shared_expert.down_proj.weight": (D, Is), p + "mlp.shared_expert_gate.weight": (1, D)})
    return out


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_checkpoint(directory: str | Path) -> tuple[ModelConfig, type[MoEArch], Checkpoint, ExpertLayout]:
    """Read and validate a checkpoint; nothing is loaded into memory yet."""
    cfg, _ = read_config(directory)
    arch = ARCHITECTURES[cfg.model_type]
    ckpt = Checkpoint(directory)
    layout = _detect_layout(ckpt, cfg, arch)
    expected = expected_shapes(cfg, layout)
    for name, shape in expected.items():
        if name not in ckpt:
            raise ExpertCacheError(f"{ckpt.dir}: missing tensor {name!r} (expected shape {list(shape)})")
        got = ckpt.info(name).shape
        if got != shape:
            raise ExpertCacheError(f"{ckpt.info(name).file}: tensor {name!r} has shape {list(got)}, "
                                   f"expected {list(shape)}")
    for name in ckpt.tensors:
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        raise ExpertCacheError(f"{ckpt.info(name).file}: unexpected tensor {name!r} for {cfg.model_type}")
    return cfg, arch, ckpt, layout


def load_dense(ckpt: Checkpoint, cfg: ModelConfig, layout: ExpertLayout, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[LayerWeights]]:
    """Embedding, final norm, LM head and every layer's dense weights, in `dtype` on `device`."""

    def read(name: str) -> torch.Tensor:
        return ckpt.read(name).to(device=device, dtype=dtype)

    def get(name: str) -> torch.Tensor:
        # Weights every step reads go to huge-page memory; fused ones are joined first.
        return host_copy(read(name))

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in ckpt else None

    def mlp(prefix: str) -> MLPWeights:
        gate_up = torch.cat([read(prefix + "gate_proj.weight"), read(prefix + "up_proj.weight")])
        return MLPWeights(host_copy(gate_up), get(prefix + "down_proj.weight"))

    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_bias = [opt(a + f"{n}_proj.bias") for n in "qkv"]
        attn = AttentionWeights(
            qkv=host_copy(torch.cat([read(a + f"{n}_proj.weight") for n in "qkv"])),
            o=get(a + "o_proj.weight"), qkv_bias=torch.cat(qkv_bias) if qkv_bias[0] is not None else None,
            o_bias=opt(a + "o_proj.bias"), q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"))
        if cfg.qk_norm == "head":
            attn.stack_head_norms(cfg.num_heads, cfg.num_kv_heads)
        lw = LayerWeights(get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"), attn)
        if cfg.sparse_layers[i]:
            lw.router = get(p + layout.router)
            if cfg.shared_expert_intermediate_size:
                lw.shared = mlp(p + "mlp.shared_expert.")
                lw.shared_gate = get(p + "mlp.shared_expert_gate.weight")
        else:
            lw.dense = mlp(p + "mlp.")
        layers.append(lw)
    return embed, get("model.norm.weight"), lm_head, layers
