"""Opening a GGUF file (llama.cpp's format) as a model: the hyperparameters from its metadata,
the dense weights under the Hugging Face names the architecture's tables use (gguf-py's own
name map translates them), and the experts as the file's quantized bytes.

llama.cpp's converter stores each MoE layer's experts as three tensors [E, rows, cols]
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), or a fused `ffn_gate_up_exps`; one expert is a
slice of each, so it spans two or three ranges of the file, each in its own storage type. Experts
stay as the file's blocks in both tiers and are dequantized only by the compute path. Dense
matrices stay as the file's blocks too (quantized ones, and F16 and BF16 ones as ggml's rows of
those types) where products take 8-bit activations (`GGUFDense.matrix`,
`Kernels.multiplies_blocks`) and the converter stored them as they are or with their
rows reordered; everything else is dequantized at load (exactly, to fp32, then the compute dtype).

A family whose layers are not all alike (Qwen3.5's `qwen35moe`, Gemma 4's `gemma4`) completes
the config from its own keys (`Architecture.gguf_config`; Gemma 4's also reads the file's tensor
table and `rope_freqs`) and undoes or keeps what the converter did to its tensors
(`Architecture.from_gguf`, its mixers).
"""

from __future__ import annotations

from pathlib import Path

import json
import sys

import gguf
import torch
from gguf.constants import GGMLQuantizationType as Q

from ..checkpoint.gguf_io import GGUFCheckpoint
from ..checkpoint.safetensors_io import Segment
from ..checkpoint.storage import GGML_DTYPES, QuantTensor, is_quantized
from ..config import ModelConfig, RopeConfig
from ..errors import ExpertCacheError
from ..kernels.dequant import SUPPORTED, dequantize
from ..tiers.layout import ExpertFormat
from . import for_gguf
from .arch import Architecture, ExpertLayout, gguf_required

# A MoE layer's experts as `expertcache pack` writes them ([E, bytes], one range per expert), and
# the metadata key that records their format.
PACKED = "ffn_exps_packed"
PACKED_FORMAT_KEY = "expertcache.packed.{layer}"
# The expert tensors of every llama.cpp MoE architecture, relative to `blk.{i}.`.
GGUF_EXPERT_NAMES = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight",
                     "down": "ffn_down_exps.weight", "gate_up": "ffn_gate_up_exps.weight"}
_ARCH_IDS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# Hugging Face names gguf-py's map does not know, by their end, with the GGUF name's end.
_EXTRA_NAMES = {"linear_attn.dt_bias": "ssm_dt.bias", "router.scale": "ffn_gate_inp.scale",
                "router.per_expert_scale": "ffn_down_exps.scale", "layer_scalar": "layer_output_scale.weight"}


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a directory that holds GGUF files and is not a Hugging Face checkpoint
    (config.json with safetensors files)."""
    if path.is_file():
        # A GGUF under another name is still one: llama.cpp goes by the magic, not the name.
        try:
            with open(path, "rb") as f:
                return path.suffix == ".gguf" or f.read(4) == b"GGUF"
        except OSError:
            return path.suffix == ".gguf"
    # GGUF repositories often carry the original config.json beside the .gguf files; without
    # safetensors weights such a directory is the GGUF model, not a checkpoint missing its weights.
    return path.is_dir() and any(path.glob("*.gguf")) and not (
        (path / "config.json").exists() and any(path.glob("*.safetensors")))


def config_from_gguf(arch: type[Architecture], gg: GGUFCheckpoint) -> ModelConfig:
    """The model's config from GGUF metadata; a missing key or a value of the wrong kind is an
    error naming it."""
    where = str(gg.files[0])
    try:
        return _config_from_gguf(arch, gg)
    except KeyError as e:
        raise ExpertCacheError(f"{where}: missing metadata key {e.args[0]!r}") from None
    except ExpertCacheError as e:
        raise ExpertCacheError(f"{where}: {e}") from None


def _config_from_gguf(arch: type[Architecture], gg: GGUFCheckpoint) -> ModelConfig:
    md = gg.metadata
    a = md.get("general.architecture")

    def get(key: str, default=None):
        return md.get(f"{a}.{key}", default)

    def need(key: str):
        return gguf_required(md, f"{a}.{key}")

    # Counts and numbers are checked before they are used (a string block count would fail in
    # range(), a zero head count in a division, a huge one would loop over billions of layers).
    def count(key: str, value=None):
        v = need(key) if value is None else value
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ExpertCacheError(f"{a}.{key} {v!r} must be an integer >= 1")
        return v

    def number(key: str, default=None) -> float:
        v = need(key) if default is None else get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ExpertCacheError(f"{a}.{key} {v!r} must be a number")
        return float(v)

    if "token_embd.weight" not in gg:
        raise ExpertCacheError("missing tensor 'token_embd.weight'")
    embd = gg.info("token_embd.weight").shape
    if len(embd) != 2:
        raise ExpertCacheError(f"tensor 'token_embd.weight' has shape {list(embd)}, expected [vocab, hidden]")
    vocab, hidden = embd
    heads = count("attention.head_count")
    blocks = count("block_count")
    if blocks > len(gg.tensors):  # every layer has tensors of its own
        raise ExpertCacheError(f"{a}.block_count {blocks} is more layers than the file's {len(gg.tensors)} "
                               "tensors can hold")
    layers = blocks - nextn_layers(md, blocks)
    kv = get("attention.head_count_kv", heads)
    family = getattr(arch, "gguf_config", None)
    if isinstance(kv, list):
        if family is None:
            raise ExpertCacheError(f"per-layer {a}.attention.head_count_kv is not supported for {a}")
        kv = kv[0]  # the family reads the list
    head_dim = get("attention.key_length") or hidden // heads
    head_dim = count("attention.key_length", head_dim)
    # llama.cpp asserts equal key and value head sizes for these families, and (but for the
    # families that read their own rotary dims) RoPE over the whole head.
    value_dim = get("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ExpertCacheError(f"{a}.attention.value_length {value_dim!r}: expected the key length {head_dim} "
                               "(keys and values of one head size)")
    rotary = get("rope.dimension_count", head_dim)
    if family is None and rotary != head_dim:
        raise ExpertCacheError(f"{a}.rope.dimension_count {rotary!r}: expected the head dim {head_dim} "
                               "(RoPE over the whole head)")
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in gg for i in range(layers))
    theta = number("rope.freq_base", 10000.0)
    if theta <= 0:
        raise ExpertCacheError(f"{a}.rope.freq_base {theta!r} must be a positive number")
    rope = _rope_from_gguf(a, get, theta, shared_rotary=a not in _OWN_ROTARY)
    norm = get("expert_weights_norm", arch.gguf_norm_topk_prob)
    if not isinstance(norm, bool):
        raise ExpertCacheError(f"{a}.expert_weights_norm {norm!r}: expected a bool")
    # Routing as llama.cpp's graphs of these families compute it: softmax, weights unscaled.
    gating = get("expert_gating_func")
    if gating is not None and (isinstance(gating, bool) or gating != 1):
        raise ExpertCacheError(f"{a}.expert_gating_func {gating!r} is not supported: expected 1 (softmax)")
    w_scale = get("expert_weights_scale")
    if w_scale is not None and (isinstance(w_scale, bool) or w_scale not in (0, 1)):
        raise ExpertCacheError(f"{a}.expert_weights_scale {w_scale!r} is not supported: expected 1.0 "
                               "(routing weights used as the router gives them)")
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens and len(tokens) != vocab:
        # llama.cpp sizes token_embd by the token list and refuses other rows; a mismatch would
        # sample ids the tokenizer lacks, or look up rows the embedding lacks.
        raise ExpertCacheError(f"tokenizer.ggml.tokens holds {len(tokens)} tokens but tensor 'token_embd.weight' "
                               f"has {vocab} rows; expected one row per token")
    eos, bos = (_special_id(gg, f"tokenizer.ggml.{role}_token_id", vocab) for role in ("eos", "bos"))
    experts = need("expert_count")
    first = next((i for i, s in enumerate(sparse) if s), 0)
    width = get("expert_feed_forward_length")
    if width is None:  # llama.cpp writes Mixtral's expert width as the feed-forward length
        width = gg.info(f"blk.{first}.ffn_down_exps.weight").shape[-1] \
            if f"blk.{first}.ffn_down_exps.weight" in gg else need("feed_forward_length")
    dense = get("feed_forward_length", 0) if not all(sparse) else 0
    all_f32 = _all_f32(gg)
    cfg = ModelConfig(
        model_type=arch.model_types[0], vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, num_experts=experts,
        top_k=need("expert_used_count"), moe_intermediate_size=width, intermediate_size=dense,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        # Required, as llama.cpp requires it: a default would let a prompt run past the trained length.
        max_position=need("context_length"), rope=rope,
        norm_topk_prob=norm,
        tie_word_embeddings="output.weight" not in gg,
        qkv_bias="blk.0.attn_q.bias" in gg, o_bias="blk.0.attn_output.bias" in gg,
        qk_norm=arch.qk_norm, clip_qkv=get("attention.clamp_kqv"),
        sparse_layers=sparse,
        shared_expert_intermediate_size=_shared_width(arch, gg, layers, get("expert_shared_feed_forward_length")),
        sliding_window=get("attention.sliding_window") or None,
        # Quantized weights compute in bf16 by default (--dtype float32 is the exact reference).
        dtype=torch.float32 if all_f32 else torch.bfloat16,
        bos_token_id=bos, eos_token_id=(eos,) if eos is not None else (),
        router_weights_fp32=arch.router_weights_fp32,
    )
    # A family with layers of its own kind reads their shapes from its own keys.
    if family is None:
        return cfg
    read = _ReadKeys(md)
    try:
        out = family(cfg, read, gg) if getattr(arch, "gguf_config_reads_file", False) else family(cfg, read)
    except (TypeError, ValueError, ExpertCacheError):
        # A string where a count was due fails inside arithmetic or a check of another key's
        # value: the key of the wrong kind is the one to name.
        _check_kinds(a, read)
        raise
    _check_kinds(a, read)  # ... or passes as the number it spells (float('4'))
    return out


def _special_id(gg: GGUFCheckpoint, key: str, vocab: int):
    """A special token id from the metadata; one outside the vocabulary is dropped with a warning, as
    llama.cpp drops it ("bad special token"), rather than the whole file refused. A value that is
    no integer is left for ModelConfig to refuse."""
    i = gg.metadata.get(key)
    if isinstance(i, int) and not isinstance(i, bool) and not 0 <= i < vocab:
        print(f"expertcache: {gg.files[0]}: ignoring {key}={i}, which is not a token id of the vocabulary "
              f"of {vocab}", file=sys.stderr)
        return None
    return i


class _ReadKeys(dict):
    """GGUF metadata that remembers which keys a family's config read (`read`)."""

    def __init__(self, md: dict):
        super().__init__(md)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


# The architecture keys llama.cpp stores as strings; every other one it reads holds numbers or bools.
_STRING_KEYS = ("rope.scaling.type", "tensor_data_layout")


def _check_kinds(a: str, md: _ReadKeys) -> None:
    """Every `{a}.*` key a family read holds numbers (or bools), not text: a value of the wrong
    kind is one line naming the key."""
    for key in sorted(md.read):
        if not key.startswith(f"{a}.") or key.removeprefix(f"{a}.") in _STRING_KEYS or key not in md:
            continue
        value = dict.__getitem__(md, key)
        if isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str) for v in value)):
            raise ExpertCacheError(f"{key} {value!r}: expected a number")


# GGUF architectures whose layers build their RoPE tables from their own keys (Gemma 4: theta and
# `rope_freqs` per layer kind) rather than from `ModelConfig.rope`: a scaling is refused there.
_OWN_ROTARY = ("gemma4",)


# The YaRN keys llama.cpp's converter writes from a rope_scaling that gives them, with the value
# llama.cpp computes these families with: it reads them only for other architectures (DeepSeek,
# Grok, ...), so for these a file's other value would be a model llama.cpp does not run.
_YARN_FIXED = {"rope.scaling.yarn_beta_fast": (32.0,), "rope.scaling.yarn_beta_slow": (1.0,),
               "rope.scaling.yarn_ext_factor": (1.0, -1.0),  # -1: llama.cpp's "computed", 1 for YaRN
               "rope.scaling.yarn_attn_factor": (1.0,), "rope.scaling.yarn_log_multiplier": (0.0,)}


def _rope_from_gguf(a: str, get, theta: float, shared_rotary: bool) -> RopeConfig:
    """RoPE as llama.cpp reads it: `rope.scaling.type` defaults to linear, its factor is
    `rope.scaling.factor` or the older `rope.scale_linear` (0 or absent: none), type none ignores
    the factor, and `rope.scaling.attn_factor` scales cos and sin whatever the type. YaRN takes
    the context before scaling from `rope.scaling.original_context_length` (0 or absent: the
    context length) and llama.cpp's fixed beta_fast 32, beta_slow 1 and magnitude 0.1 ln(factor) + 1,
    the function transformers computes for a rope_scaling of {yarn, factor, original_max_position_embeddings}."""
    kind = get("rope.scaling.type")
    key = "rope.scaling.factor" if get("rope.scaling.factor") is not None else "rope.scale_linear"
    factor = get(key, 0.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 0:
        raise ExpertCacheError(f"{a}.{key} {factor!r}: expected a number >= 0")
    attn = get("rope.scaling.attn_factor")
    if attn is not None and (isinstance(attn, bool) or attn != 1):
        raise ExpertCacheError(f"{a}.rope.scaling.attn_factor {attn!r} is not supported: expected 1.0")
    if kind not in (None, "none", "linear", "yarn"):
        raise ExpertCacheError(f"{a}.rope.scaling.type {kind!r} is not supported: expected none, linear or yarn")
    if kind == "yarn":
        for k, fixed in _YARN_FIXED.items():
            v = get(k)
            if v is not None and (isinstance(v, bool) or v not in fixed):
                raise ExpertCacheError(f"{a}.{k} {v!r} is not supported: expected {fixed[0]} (llama.cpp computes "
                                       f"{a} with {fixed[0]} whatever the file says)")
    # llama.cpp reads the original context whatever the type: a YaRN asked for at load time
    # (`--rope-scaling yarn`) starts from it.
    original = get("rope.scaling.original_context_length", 0)
    if isinstance(original, bool) or not isinstance(original, int) or original < 0:
        raise ExpertCacheError(f"{a}.rope.scaling.original_context_length {original!r}: expected an integer "
                               ">= 0 (the context before YaRN; 0: the context length)")
    if kind == "none" or (kind in (None, "linear", "yarn") and factor in (0, 1)):
        # YaRN at factor 1 interpolates nothing and scales by 1: plain RoPE, as in llama.cpp,
        # which still counts the type as the model's (a `--rope-scale` alone keeps it).
        return RopeConfig(theta=theta, original_max_position=original or None,
                          train_type=kind if kind in ("none", "yarn") else None)
    if not shared_rotary:
        raise ExpertCacheError(f"{a}.{key} {factor!r}: {kind or 'linear'} RoPE scaling is not supported for {a}")
    if kind == "yarn":
        if not original:
            original = get("context_length")
            if original is None:
                raise KeyError(f"{a}.context_length")
        return RopeConfig(theta=theta, type="yarn", factor=float(factor), original_max_position=original)
    return RopeConfig(theta=theta, type="linear", factor=float(factor), original_max_position=original or None)


def _shared_width(arch: type[Architecture], gg: GGUFCheckpoint, layers: int, width) -> int:
    """The shared expert's width: `expert_shared_feed_forward_length`, or where a converter wrote
    none or 0, the width of the shared expert's tensors (llama.cpp then takes feed_forward_length,
    which those tensors must match)."""
    if width or arch.shared_expert_width is None:
        return width or 0
    name = next((f"blk.{i}.ffn_down_shexp.weight" for i in range(layers) if f"blk.{i}.ffn_down_shexp.weight" in gg),
                None)
    return gg.info(name).shape[-1] if name is not None else 0


def nextn_layers(md: dict, blocks: int | None = None) -> int:
    """The multi-token-prediction (NextN) layers a GGUF holds after the model's own: llama.cpp's
    converter writes Qwen3.5/3.6's MTP head as the last `{arch}.nextn_predict_layers` blocks and
    counts them in `block_count`. The main model never runs them (llama.cpp loads them for
    speculative decoding only), so the loader skips them."""
    a = md.get("general.architecture")
    n = md.get(f"{a}.nextn_predict_layers", 0)
    blocks = md.get(f"{a}.block_count") if blocks is None else blocks
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < blocks:
        raise ExpertCacheError(f"{a}.nextn_predict_layers {n!r}: expected an integer from 0 to "
                               f"{a}.block_count - 1 ({blocks - 1})")
    return n


def _all_f32(gg: GGUFCheckpoint) -> bool:
    """Whether every weight is F32 (the model then computes in fp32 by default): a layer's experts
    packed by `expertcache pack` (one I8 tensor) by the types its format names, so that a packed
    copy computes as its source."""
    for name, info in gg.tensors.items():
        if name.endswith(f".{PACKED}"):
            try:
                parts = json.loads(gg.metadata[PACKED_FORMAT_KEY.format(layer=int(name.split(".")[1]))])
                if any(t != "F32" for _, t, _ in parts):
                    return False
            except (KeyError, ValueError, TypeError):
                return False  # a malformed format: GGUFExperts names it when it reads the layer
        elif info.storage != torch.float32:
            return False
    return True


def _check_storage(info) -> None:
    """A storage type the dequantization and the kernels know (`kernels.dequant.SUPPORTED`), so that
    a file of another type is refused when opened, not at its first product."""
    if is_quantized(info.storage) and info.storage not in SUPPORTED:
        raise ExpertCacheError(f"{info.file}: tensor {info.name!r} has storage type {info.qtype.name}, expected "
                               f"one of {', '.join(q.name for q in SUPPORTED)}")


class GGUFDense:
    """The dense tensors of a GGUF file under Hugging Face names, dequantized when read: what the
    loader reads a safetensors checkpoint through (`read`, `in`)."""

    def __init__(self, gg: GGUFCheckpoint, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 arch: type[Architecture], cfg: ModelConfig):
        self.gg, self.names, self.shapes, self.arch, self.cfg = gg, names, shapes, arch, cfg
        self.files = gg.files
        self.metadata = gg.metadata  # the tokenizer and chat template come from here

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self.names

    def read(self, hf_name: str) -> torch.Tensor:
        name = self.names[hf_name]
        info = self.gg.info(name)
        raw = self.gg.read(name)
        t = dequantize(raw, info.storage, info.shape) if is_quantized(info.storage) else raw.view(info.storage) \
            .view(info.shape)
        return self.arch.from_gguf(hf_name, t.float().reshape(self.shapes[hf_name]), self.cfg)

    def matrix(self, hf_name: str) -> QuantTensor | None:
        """A quantized, F16 or BF16 matrix as the file's rows (ggml's blocks), with the rows in the
        order `read` gives them; None for F32, or when the converter changed it other than by
        reordering rows. (Each row is its own blocks, so a row order can be undone on the bytes;
        anything else is undone on the dequantized values by `read`.) F16 and BF16 stay so because
        ggml rounds a product's input to fp16 or bf16 before multiplying them: dequantized at load,
        the products of `--activations q8` took the input as it was (`Kernels.linear_blocks`)."""
        order = self.row_order(hf_name, halves=True)
        if order is None:
            return None
        name, shape = self.names[hf_name], self.shapes[hf_name]
        q = QuantTensor(self.gg.read(name).view(shape[0], -1), self.gg.info(name).qtype, tuple(shape))
        return q if torch.equal(order, torch.arange(shape[0])) else q.take(order)

    def row_order(self, hf_name: str, halves: bool = False) -> torch.Tensor | None:
        """For a quantized matrix (or, with `halves`, an F16 or BF16 one) the converter stored as it
        is or with its rows reordered: the file's row behind each row `read` gives; None for
        anything else. Reads no weight."""
        info, shape = self.gg.info(self.names[hf_name]), self.shapes[hf_name]
        kept = is_quantized(info.storage) or (halves and info.storage in (torch.float16, torch.bfloat16))
        if not kept or len(shape) != 2 or tuple(info.shape) != tuple(shape):
            return None
        rows = torch.arange(shape[0], dtype=torch.float64)[:, None]  # [N, 1]: what from_gguf does to rows
        moved = self.arch.from_gguf(hf_name, rows, self.cfg)
        if not isinstance(moved, torch.Tensor) or moved.shape != rows.shape or \
                not torch.equal(moved[:, 0].sort().values, rows[:, 0]):
            return None
        return moved[:, 0].long()


class GGUFExperts:
    """A GGUF file's experts as bytes (`tiers.store.ExpertSource`): expert e of layer i is slice e
    of each expert tensor of block i, in the file's storage types."""

    def __init__(self, gg: GGUFCheckpoint, cfg: ModelConfig):
        self.gg, self.cfg = gg, cfg
        self.files = gg.files
        self.layers = cfg.moe_layers
        self.num_experts = cfg.num_experts
        self._names: dict[int, list[tuple[str, str]]] = {}
        self._formats: dict[int, ExpertFormat] = {}
        D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        for i in self.layers:
            if f"blk.{i}.{PACKED}" in gg:  # written by `expertcache pack`: one range per expert
                self._names[i], self._formats[i] = self._packed(i)
                continue
            fused = f"blk.{i}.{GGUF_EXPERT_NAMES['gate_up']}" in gg
            parts = [("gate_up", (2 * I, D)), ("down", (D, I))] if fused else \
                [("gate", (I, D)), ("up", (I, D)), ("down", (D, I))]
            names, fmt = [], []
            for part, shape in parts:
                name = f"blk.{i}.{GGUF_EXPERT_NAMES[part]}"
                if name not in gg:
                    # llama.cpp's converter wrote each expert as tensors of its own before April 2024
                    # (the Mixtral files of then), which llama.cpp merged into these at load.
                    old = f"blk.{i}.ffn_{part}.0.weight"
                    layout = (f"; the file holds one tensor per expert ({old!r}, llama.cpp's layout before "
                              "April 2024), which is not read here: convert the model again") if old in gg else ""
                    raise ExpertCacheError(f"{gg.files[0]}: missing tensor {name!r} "
                                           f"(expected shape {[E, *shape]}){layout}")
                info = gg.info(name)
                if tuple(info.shape) != (E, *shape):
                    raise ExpertCacheError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, "
                                           f"expected {[E, *shape]}")
                _check_storage(info)
                names.append((part, name))
                fmt.append((part, info.storage, shape))
            self._names[i] = names
            self._formats[i] = ExpertFormat.of(fmt)

    @property
    def dtype(self) -> torch.dtype | None:
        """The float dtype of the experts, when they are not quantized."""
        m = self._formats[self.layers[0]].matrices[0]
        return None if is_quantized(m.storage) else m.storage

    def _packed(self, i: int) -> tuple[list[tuple[str, str]], ExpertFormat]:
        name = f"blk.{i}.{PACKED}"
        key = PACKED_FORMAT_KEY.format(layer=i)
        try:
            parts = [(n, GGML_DTYPES.get(Q[t], Q[t]), tuple(shape)) for n, t, shape in json.loads(self.gg.require(key))]
            fmt = ExpertFormat.of(parts)
            for m in fmt.matrices:
                if is_quantized(m.storage) and m.storage not in SUPPORTED:
                    raise ValueError(m.storage)
        except (ValueError, KeyError, TypeError):
            raise ExpertCacheError(f"{self.gg.files[0]}: metadata {key!r} is not a packed expert format "
                                   "(expected [[name, type, [rows, cols]], ...])") from None
        info = self.gg.info(name)
        if tuple(info.byte_shape) != (self.num_experts, fmt.nbytes):
            raise ExpertCacheError(f"{info.file}: tensor {name!r} holds {list(info.byte_shape)} bytes, expected "
                                   f"{[self.num_experts, fmt.nbytes]} for {fmt.describe()}")
        return [("packed", name)], fmt

    def format(self, layer: int) -> ExpertFormat:
        return self._formats[layer]

    def segments(self, layer: int, e: int) -> list[Segment]:
        names = self._names[layer]
        if names[0][0] == "packed":
            info = self.gg.info(names[0][1])
            each = info.nbytes // info.shape[0]
            return [Segment(info.file, info.offset + e * each, each)]
        return [self.gg.segment(name, e) for _, name in names]

    def run_parts(self, layer: int, first: int, n: int) -> list[tuple[Segment, int, int]]:
        # An expert is a slice of each of two or three tensors: a run is one read per tensor.
        names, fmt = self._names[layer], self._formats[layer]
        if names[0][0] == "packed":
            a = self.segments(layer, first)[0]
            return [(Segment(a.file, a.offset, a.nbytes * n), 0, fmt.nbytes)]
        out = []
        for (_, name), m in zip(names, fmt.matrices):
            a = self.gg.segment(name, first)
            out.append((Segment(a.file, a.offset, a.nbytes * n), m.offset, m.nbytes))
        return out

    def read(self, layer: int, e: int) -> torch.Tensor:
        if self._names[layer][0][0] == "packed":
            return self.gg.read_range(self.segments(layer, e)[0])
        return torch.cat([self.gg.read_rows(name, e).reshape(-1) for _, name in self._names[layer]])


def hf_names(cfg: ModelConfig, arch: type[Architecture], expected: dict[str, tuple[int, ...]],
             gg: GGUFCheckpoint, optional: dict[str, tuple[int, ...]] | None = None) -> dict[str, str]:
    """The GGUF name of every dense Hugging Face tensor the architecture expects, checked, and of
    each `optional` one the file holds."""
    name = gg.metadata.get("general.architecture")
    tmap = gguf.get_tensor_name_map(_ARCH_IDS[name], cfg.num_layers)
    out = {}
    for hf, shape in {**expected, **(optional or {})}.items():
        g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is None or g not in gg:
            end = next((e for e in _EXTRA_NAMES if hf.endswith(e)), None)
            layer = next((i for i in range(cfg.num_layers) if f".{i}." in hf), None)
            if end is not None and layer is not None:
                g = f"blk.{layer}.{_EXTRA_NAMES[end]}"
        if hf not in expected and (g is None or g not in gg):
            continue
        if g is None or g not in gg:
            raise ExpertCacheError(f"{gg.files[0]}: missing tensor {g or hf!r} (expected shape {list(shape)})")
        got = tuple(gg.info(g).shape)
        # llama.cpp drops axes of 1: a [1, D] gate is a vector [D], a [C, 1, K] conv is [C, K].
        if got != shape and tuple(d for d in got if d != 1) != tuple(d for d in shape if d != 1):
            raise ExpertCacheError(f"{gg.info(g).file}: tensor {g!r} has shape {list(got)}, expected {list(shape)}")
        out[hf] = g
    return out


def dense_expected(cfg: ModelConfig, arch: type[Architecture], expected: dict[str, tuple[int, ...]],
                   layout: ExpertLayout) -> dict[str, tuple[int, ...]]:
    """The expected tensors less the experts (which are read as the file's blocks)."""
    marks = [getattr(layout, p) for p in ("gate", "up", "down", "gate_up") if getattr(layout, p)]
    heads = [m.split("{e}")[0] if "{e}" in m else m for m in marks]
    return {n: s for n, s in expected.items() if not any(h in n for h in heads)}


def open_gguf(path: Path):
    """Read and validate a GGUF model; nothing but the metadata and tensor table is read yet."""
    from .loader import OpenedModel, expected_shapes, optional_shapes

    gg = GGUFCheckpoint(path)
    arch = for_gguf(gg.metadata, str(gg.files[0]))
    cfg = config_from_gguf(arch, gg)
    layout = arch.expert_layouts[0]
    dense = dense_expected(cfg, arch, expected_shapes(cfg, arch, layout), layout)
    optional = optional_shapes(cfg, arch)
    names = hf_names(cfg, arch, dense, gg, optional)
    shapes = {**dense, **{n: s for n, s in optional.items() if n in names}}
    experts = GGUFExperts(gg, cfg)
    used = {*names.values(), *(n for i in experts.layers for _, n in experts._names[i]), *arch.gguf_extra_tensors}
    mtp = tuple(f"blk.{i}." for i in range(cfg.num_layers, cfg.num_layers + nextn_layers(gg.metadata)))
    skipped = 0
    for name, info in gg.tensors.items():
        if mtp and name.startswith(mtp):
            skipped += 1
            continue
        # llama.cpp refuses a tensor it would not use; skipping one (a shared expert, a bias) would
        # compute another model than the file's without a word.
        if name not in used:
            raise ExpertCacheError(f"{info.file}: unexpected tensor {name!r} for {gg.metadata['general.architecture']}")
        if name in names.values():
            _check_storage(info)
    if skipped:
        print(f"expertcache: {gg.files[0]}: skipping the multi-token-prediction layer{'s' * (len(mtp) > 1)} "
              f"({', '.join(p + '*' for p in mtp)}: {skipped} tensors), which this engine does not run",
              file=sys.stderr)
    return OpenedModel(Path(path), cfg, arch, GGUFDense(gg, names, shapes, arch, cfg), layout, experts)
