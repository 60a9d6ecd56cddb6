"""jaxserve models: HF / GGUF checkpoint loading and the paged forward pass of every family."""

from models.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig, parse_config
from models.model import Model, load_model
from models.ops import KernelOptions
from models.safetensors_io import CheckpointError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "ConfigError",
    "KernelOptions",
    "Model",
    "ModelConfig",
    "load_model",
    "parse_config",
]
