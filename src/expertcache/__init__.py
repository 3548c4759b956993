"""expertcache: run Mixture-of-Experts models whose experts do not fit in fast memory."""

from .config import CacheConfig, ModelConfig
from .engine import GenerationResult, Model, Session, load
from .errors import ExpertCacheError

__all__ = ["CacheConfig", "ExpertCacheError", "GenerationResult", "Model", "ModelConfig", "Session", "load"]
__version__ = "0.1.0"
