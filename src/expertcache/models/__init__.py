"""Model architectures: one small file of data per family over one shared decoder stack, and
the one registry that config parsing, loading, `info` and error messages use."""

from __future__ import annotations

from ..errors import ExpertCacheError
from .arch import Architecture
from .gemma4 import Gemma4
from .mixtral import Mixtral
from .olmoe import Olmoe
from .qwen2_moe import Qwen2Moe
from .qwen3_5_moe import Qwen35Moe
from .qwen3_moe import Qwen3Moe

ARCHITECTURES: tuple[type[Architecture], ...] = (Qwen3Moe, Qwen2Moe, Olmoe, Mixtral, Qwen35Moe, Gemma4)


def supported() -> str:
    return ", ".join(t for a in ARCHITECTURES for t in a.model_types)


def for_model_type(model_type, where: str) -> type[Architecture]:
    """The architecture of a Hugging Face `model_type`."""
    for a in ARCHITECTURES:
        if model_type in a.model_types:
            return a
    raise ExpertCacheError(f"{where}: unsupported model_type {model_type!r}: supported are {supported()}")


def for_gguf(metadata: dict, where: str) -> type[Architecture]:
    """The architecture of a GGUF file, from `general.architecture` and, where llama.cpp shares
    that name between families, the rest of the metadata."""
    name = metadata.get("general.architecture")
    if name is None:
        raise ExpertCacheError(f"{where}: metadata key 'general.architecture' is missing (expected the model's "
                               "architecture, such as qwen3moe)")
    named = [a for a in ARCHITECTURES if name in a.gguf_architectures]
    for a in named:
        if a.matches_gguf(metadata):
            return a
    ours = ", ".join(n for a in ARCHITECTURES for n in a.gguf_architectures)
    what = f"{name!r} without experts" if named else repr(name)
    raise ExpertCacheError(f"{where}: unsupported architecture {what}: supported are MoE models of {ours}")
