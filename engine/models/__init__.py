"""Model definitions and loading."""
from engine.models.config import SUPPORTED_ARCHITECTURES, ArchConfig, ModelLoadError, load_arch_config
from engine.models.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchConfig", "ModelLoadError", "load_arch_config", "load_model"]
