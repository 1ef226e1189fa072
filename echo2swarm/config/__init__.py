"""Typed per-role configuration: pydantic models, TOML loading, env and CLI overrides."""

from echo2swarm.config.loading import ConfigError, dump_config, load_config
from echo2swarm.config.models import (
    BootstrapConfig,
    ChunkServerConfig,
    FetchConfig,
    LearnerConfig,
    OverlayConfig,
    PublishConfig,
    RelayConfig,
    RolloutConfig,
    StoreConfig,
)

__all__ = [
    "BootstrapConfig", "ChunkServerConfig", "ConfigError", "FetchConfig", "LearnerConfig", "OverlayConfig",
    "PublishConfig", "RelayConfig", "RolloutConfig", "StoreConfig", "dump_config", "load_config",
]
