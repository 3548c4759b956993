"""Packing a GGUF file: the same tensors and metadata, but each MoE layer's experts as one
tensor [E, bytes] in which expert e is one contiguous range (its gate, up and down blocks back
to back, each in the file's storage type), so that a run of experts is one read.

The output loads in expertcache; llama.cpp does not know the packed tensor (it need not: it is a
layout for the expert cache's slow tier). Each packed layer's expert format (matrix names,
storage types, shapes) is recorded in the metadata under `expertcache.packed.{layer}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from tqdm import tqdm

from ..checkpoint.gguf_io import GGUFCheckpoint
from ..checkpoint.writer import DATA_ALIGN, atomic_gguf, check_output_file
from ..errors import ExpertCacheError
from .gguf_loader import GGUF_EXPERT_NAMES, PACKED, PACKED_FORMAT_KEY, GGUFExperts, config_from_gguf
from . import for_gguf
from .synth_gguf import MARKER_KEY, _is_ours



def pack_gguf(src: str | Path, out: str | Path, force: bool = False, progress: bool = True) -> Path:
    gg = GGUFCheckpoint(src)
    out = Path(out)
    if out.resolve() in [f.resolve() for f in gg.files]:
        raise ExpertCacheError(f"output {str(out)!r} is the source: expected another path")
    out = check_output_file(out, force, "a file written by expertcache", _is_ours)
    cfg = config_from_gguf(for_gguf(gg.metadata, str(gg.files[0])), gg)
    experts = GGUFExperts(gg, cfg)
    arch = gg.metadata["general.architecture"]
    with atomic_gguf(out, arch) as w:
        for key, value in gg.metadata.items():
            if (key in ("general.architecture", "general.alignment", MARKER_KEY) or key.startswith("split.")
                    or key.startswith("expertcache.")):
                continue
            types = gg.metadata_types[key]
            w.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
        w.add_string(MARKER_KEY, "expertcache pack")
        # Each tensor on a 4 KiB page: where an expert's bytes are a whole number of pages (Qwen3-30B's
        # Q4_K_M experts; not Gemma 4's, whose 704-wide rows fall back to Q5_0/Q8_0: 877.25 pages),
        # the disk store reads it with O_DIRECT (tiers/store.py).
        w.add_custom_alignment(DATA_ALIGN)
        expert_names = {f"blk.{i}.{GGUF_EXPERT_NAMES[p]}" for i in cfg.moe_layers for p in GGUF_EXPERT_NAMES}
        # A packed source's experts too: they are written again below (copied as well, they were a
        # second tensor of the same name, which gguf-py refused with a traceback).
        expert_names |= {f"blk.{i}.{PACKED}" for i in cfg.moe_layers}
        plan = []
        for name, info in gg.tensors.items():
            if name in expert_names:
                continue
            w.add_tensor_info(name, info.byte_shape, np.dtype(np.uint8), info.nbytes, raw_dtype=info.qtype)
            plan.append((name, None))
        for i in cfg.moe_layers:
            fmt = experts.format(i)
            w.add_string(PACKED_FORMAT_KEY.format(layer=i), json.dumps(
                [[m.name, _type_name(m.storage), list(m.shape)] for m in fmt.matrices]))
            name = f"blk.{i}.{PACKED}"
            w.add_tensor_info(name, (cfg.num_experts, fmt.nbytes), np.dtype(np.int8), cfg.num_experts * fmt.nbytes,
                              raw_dtype=Q.I8)
            plan.append((name, i))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, layer in tqdm(plan, desc="packing", unit="tensor",
                                disable=None if progress else True):  # None: a bar only on a terminal
            if layer is None:
                w.write_tensor_data(gg.read(name).numpy())
            else:
                rows = np.stack([experts.read(layer, e).numpy() for e in range(cfg.num_experts)])
                w.write_tensor_data(rows.view(np.int8))
    return out


def _type_name(storage) -> str:
    return storage.name if isinstance(storage, Q) else {"torch.float32": "F32", "torch.float16": "F16",
                                                         "torch.bfloat16": "BF16"}[str(storage)]
