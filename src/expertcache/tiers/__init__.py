"""The two tiers of expert memory and the cache between them."""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..errors import ExpertCacheError
from ..models.moe import ResidentExperts, padded_numel


def build_experts(source, cache: CacheConfig, device: torch.device, dtype: torch.dtype):
    """The expert provider the MoE layers read from, as `cache` asks."""
    if cache.mode != "resident":
        raise ExpertCacheError(f"cache mode {cache.mode!r} is not available yet")
    cfg = source.cfg
    stride = padded_numel(source.numel, dtype.itemsize)
    layers = {}
    for layer in cfg.moe_layers:
        rows = torch.zeros(cfg.num_experts, stride, device=device, dtype=dtype)
        for e in range(cfg.num_experts):
            rows[e, : source.numel].copy_(source.read(layer, e))
        layers[layer] = rows
    return ResidentExperts(layers, cfg.hidden_size, cfg.moe_intermediate_size)
