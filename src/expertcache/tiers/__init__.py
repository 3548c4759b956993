"""The two tiers of expert memory and the cache between them. Nothing here knows a model
architecture: experts are bytes described by an `ExpertFormat`, read through an `ExpertSource`."""

from __future__ import annotations

import torch

from ..config import CacheConfig
from .cache import ExpertCache
from .store import ExpertSource, ExpertStore, make_store


def make_store_for(source: ExpertSource, cache: CacheConfig, device: torch.device,
                   dtype: torch.dtype) -> ExpertStore:
    # Resident mode copies every expert into the pool once; a RAM copy beside it would double
    # the memory, so it fills from the memory-mapped checkpoint instead.
    name = "mmap" if cache.mode == "resident" and cache.store == "ram" else cache.store
    return make_store(name, source, dtype, device)


def build_experts(source: ExpertSource, cache: CacheConfig, device: torch.device, dtype: torch.dtype) -> ExpertCache:
    """The expert provider the MoE layers read from: a slot cache over the chosen slow tier."""
    return ExpertCache(make_store_for(source, cache, device, dtype), cache, device)
