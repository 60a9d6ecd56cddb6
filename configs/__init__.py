"""jaxserve launch configs: the YAML files in this directory and the schema that validates them."""

from configs.schema import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    DEFAULTS,
    CacheSection,
    CompileConfig,
    ConfigError,
    KernelsConfig,
    KVTransferSection,
    LaunchConfig,
    MeshConfig,
    ModelSection,
    MultihostConfig,
    ParallelConfig,
    SchedulerSection,
    ServerConfig,
    load_config,
    parse_override,
)

__all__ = [
    "CONFIG_DIR", "DEFAULTS", "DEFAULT_CONFIG", "CacheSection", "CompileConfig", "ConfigError", "KVTransferSection",
    "KernelsConfig", "LaunchConfig", "MeshConfig", "ModelSection", "MultihostConfig", "ParallelConfig",
    "SchedulerSection", "ServerConfig", "load_config", "parse_override",
]
