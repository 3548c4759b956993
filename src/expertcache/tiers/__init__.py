"""The two tiers of expert memory and the cache between them. Nothing here knows a model
architecture: experts are bytes described by an `ExpertFormat`, read through an `ExpertSource`."""

from __future__ import annotations

import torch

from ..config import CacheConfig
from .cache import ExpertCache
from .layout import Tiler
from .store import ExpertSource, ExpertStore, make_store


def make_store_for(source: ExpertSource, cache: CacheConfig, device: torch.device,
                   dtype: torch.dtype, tiler: Tiler | None = None) -> ExpertStore:
    """The slow tier `cache` names. `tiler` (the CPU's kernels) has the matrices it reads as tiles
    held so where each slot is filled once: by the RAM store, which forms them at load (and fills
    slots with the kernels' copy), and in resident mode. The file stores of the other modes copy
    the file's bytes straight into slots on every miss, where forming tiles would add a pass over
    each expert to the copy."""
    # Resident mode copies every expert into the pool once; a RAM copy beside it would double
    # the memory, so it fills from the memory-mapped checkpoint instead.
    name = "mmap" if cache.mode == "resident" and cache.store == "ram" else cache.store
    once = name == "ram" or cache.mode == "resident"
    return make_store(name, source, dtype, device, tiler if once and device.type == "cpu" else None)


def build_experts(source: ExpertSource, cache: CacheConfig, device: torch.device, dtype: torch.dtype,
                  tiler: Tiler | None = None) -> ExpertCache:
    """The expert provider the MoE layers read from: a slot cache over the chosen slow tier."""
    store = make_store_for(source, cache, device, dtype, tiler)
    try:
        return ExpertCache(store, cache, device)
    except BaseException:  # a cache too small for one wave: the store's files are open
        store.close()
        raise
