"""Typed per-role configuration: pydantic models, TOML loading, env and CLI overrides.

    models.py   one root model per role (LearnerConfig, RolloutConfig, RelayConfig, BootstrapConfig)
    rl.py       the RL loop's sections (train, leases, engine, worker, activation)
    loading.py  defaults < TOML < ECHO2SWARM_* < flags, errors that name the setting to change
    flags.py    which daemon flag sets which field (import-light: the CLI reads it for --help)

Import from the submodules: importing this package stays free of pydantic, so `--help` is instant.
"""
