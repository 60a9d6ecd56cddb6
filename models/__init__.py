"""jaxserve models: HF / GGUF checkpoint loading and the paged forward pass of every family.

The names below are imported on first use (PEP 562), so that light submodules such as
`models.registry` or `models.padding` can be imported without JAX (the scheduler side must not
import it: tests/test_scheduler.py)."""

import importlib

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "models.config",
    "ConfigError": "models.config",
    "ModelConfig": "models.config",
    "parse_config": "models.config",
    "Model": "models.model",
    "load_model": "models.model",
    "KernelOptions": "models.ops",
    "CheckpointError": "models.safetensors_io",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
