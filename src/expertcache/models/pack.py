"""Packing: write an expert-major checkpoint in which each layer's experts are stored in
id order, each expert (gate, up, down) one contiguous range, so a run of experts is one read.

The output is still safetensors, and every expertcache command loads it: per MoE layer the
router is `model.layers.{i}.mlp.gate.weight` and the experts one tensor
`model.layers.{i}.mlp.experts.packed` [E, 3 * I * D]. Everything else keeps its name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoint.writer import PlannedTensor, atomic_output_dir, copy_side_files, write_safetensors
from ..config import parse_dtype
from ..errors import ExpertCacheError
from ..tiers.store import convert
from .arch import PACKED_LAYOUT
from .loader import expected_shapes, open_model, optional_shapes


def pack(model_dir: str | Path, out: str | Path, dtype=None, force: bool = False, progress: bool = True) -> Path:
    m = open_model(model_dir)
    cfg, ckpt, layout, source = m.cfg, m.ckpt, m.layout, m.experts
    out_dtype = parse_dtype(dtype) or source.dtype
    planned: list[PlannedTensor] = []
    src_names = expected_shapes(cfg, m.arch, layout)
    src_names.update({n: s for n, s in optional_shapes(cfg, m.arch).items() if n in ckpt})
    expert_parts = {getattr(layout, f) for f in ("gate", "up", "down", "gate_up", "packed") if getattr(layout, f)}
    names = m.arch.names(cfg)
    in_layer = re.compile(re.escape(names["layer"]).replace(re.escape("{i}"), r"\d+"))
    for name, shape in src_names.items():
        hit = in_layer.match(name)
        suffix = name[hit.end():] if hit else None
        if suffix is not None and any(_matches(suffix, part) for part in expert_parts):
            continue  # experts are written packed below
        new_name = name
        if suffix == layout.router:
            new_name = name[: -len(suffix)] + PACKED_LAYOUT.router
        # Without --dtype each tensor keeps its own dtype: a float32 router or norm beside bf16
        # experts, rounded to theirs, gave other logits than the source's computed in float32.
        keep = parse_dtype(dtype) or ckpt.info(name).dtype
        planned.append(PlannedTensor(new_name, keep, shape,
                                     lambda n=name, keep=keep: iter([_in_range(n, ckpt.read(n), keep)])))
    prefix = names["layer"]
    for layer in cfg.moe_layers:
        src_fmt = source.format(layer)
        # Written as gate, up, down of each expert in `out_dtype`: the packed layout's format.
        out_fmt = src_fmt.with_dtype(out_dtype)

        def experts(layer=layer, src_fmt=src_fmt, out_fmt=out_fmt):
            for e in range(cfg.num_experts):
                row = torch.empty(1, out_fmt.nbytes, dtype=torch.uint8)
                src = source.read(layer, e)
                convert(src[None], src_fmt, row, out_fmt)
                for a, b in zip(src_fmt.matrices, out_fmt.matrices):
                    if a.storage != b.storage:
                        _in_range(f"layer {layer} expert {e} {a.name}",
                                  src[a.offset: a.offset + a.nbytes].view(a.storage),
                                  row[0, b.offset: b.offset + b.nbytes].view(b.storage))
                yield row[0].view(out_dtype)
        planned.append(PlannedTensor(prefix.format(i=layer) + PACKED_LAYOUT.packed, out_dtype,
                                     (cfg.num_experts, 3 * cfg.hidden_size * cfg.moe_intermediate_size), experts))
    total = sum(t.nbytes for t in planned)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if dtype is not None:
        # The copy computes in --dtype: said wherever the config says a dtype, since a multimodal
        # config's text_config, which the loader reads over the outer keys, overrode the outer one.
        for c in (raw, raw.get("text_config")):
            if isinstance(c, dict) and (c is raw or "dtype" in c or "torch_dtype" in c):
                c.pop("torch_dtype", None)
                c["dtype"] = str(out_dtype).removeprefix("torch.")
    # Without --dtype the config is left as it is: the copy computes in the dtype the source does
    # (its config's; the experts' dtype, written there, made bf16 experts of a float32 config
    # compute in bf16).
    with atomic_output_dir(Path(out), force, sources=(Path(model_dir),)) as tmp:
        with tqdm(total=total, unit="B", unit_scale=True, desc="packing",
                  disable=None if progress else True) as bar:  # None: a bar only on a terminal
            write_safetensors(tmp / "model.safetensors", planned, bar.update)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        copy_side_files(Path(model_dir), tmp)
    return Path(out)


def _in_range(name: str, src: torch.Tensor, out: torch.Tensor | torch.dtype) -> torch.Tensor:
    """`src` in the written dtype (`out`: the dtype, or `src` converted already), refused where a
    finite weight became infinite: --dtype float16 holds at most 65504, which bf16 and fp32 weights
    may exceed, and an inf weight would be written without a word and give NaN logits."""
    if isinstance(out, torch.dtype):
        out = src.to(out)
    if out.dtype != src.dtype and bool(torch.isinf(out).any()) and not bool(torch.isinf(src).any()):
        dtype = str(out.dtype).removeprefix("torch.")
        raise ExpertCacheError(f"{name}: a weight is beyond the range of --dtype {dtype} (largest "
                               f"{src.abs().max().item():g}): expected a dtype that holds it")
    return out


def _matches(suffix: str, pattern: str) -> bool:
    if "{e}" not in pattern:
        return suffix == pattern
    head, tail = pattern.split("{e}")
    return suffix.startswith(head) and suffix.endswith(tail) and suffix[len(head): len(suffix) - len(tail)].isdigit()
