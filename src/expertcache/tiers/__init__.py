"""The two tiers of expert memory and the cache between them."""

from __future__ import annotations

import torch

from ..config import CacheConfig
from .cache import ExpertCache
from .layout import padded_numel
from .store import ExpertStore, make_store


def make_store_for(source, cache: CacheConfig, device: torch.device, dtype: torch.dtype) -> ExpertStore:
    stride = padded_numel(source.numel, dtype.itemsize)
    # Resident mode copies every expert into the pool once; a RAM copy beside it would double
    # the memory, so it fills from the memory-mapped checkpoint instead.
    name = "mmap" if cache.mode == "resident" and cache.store == "ram" else cache.store
    return make_store(name, source, dtype, stride, device)


def build_experts(source, cache: CacheConfig, device: torch.device, dtype: torch.dtype) -> ExpertCache:
    """The expert provider the MoE layers read from: a slot cache over the chosen slow tier."""
    return ExpertCache(make_store_for(source, cache, device, dtype), cache, device)
