"""jaxserve launch configs: the YAML files in this directory and the schema that validates them."""

from configs.schema import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    CacheConfig,
    CompileConfig,
    ConfigError,
    KernelsConfig,
    LaunchConfig,
    MeshConfig,
    ModelConfig,
    MultihostConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    load_config,
    parse_override,
)

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "CacheConfig", "CompileConfig", "ConfigError", "KernelsConfig",
    "LaunchConfig", "MeshConfig", "ModelConfig", "MultihostConfig", "ParallelConfig",
    "SchedulerConfig", "ServerConfig", "load_config", "parse_override",
]
