"""Model architectures: one small file of data per family over one shared decoder stack."""

from .base import MoEArch
from .mixtral import Mixtral
from .olmoe import Olmoe
from .qwen2_moe import Qwen2Moe
from .qwen3_moe import Qwen3Moe

ARCHITECTURES: dict[str, type[MoEArch]] = {a.model_type: a for a in (Qwen3Moe, Qwen2Moe, Olmoe, Mixtral)}
