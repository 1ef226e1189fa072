"""Typed per-role configuration: pydantic models, TOML loading, env and CLI overrides.

    models.py   one root model per role (LearnerConfig, RolloutConfig, RelayConfig, VerifierConfig, BootstrapConfig)
                and the overlay, chunk server, fetch, store, supervisor and publish sections
    rl.py       the RL loop's sections (train, leases, peers, engine, worker, activation, verify)
    metrics.py  where the learner logs its metrics
    loading.py  defaults < TOML < ECHO2SWARM_* < flags, errors that name the setting to change
    flags.py    which daemon flag sets which field (import-light: the CLI reads it for --help)
    maddr.py, units.py  multiaddr syntax and byte sizes, checked without hivemind

Import from the submodules: importing this package stays free of pydantic, so `--help` is instant.
"""
