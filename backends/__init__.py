"""Built-in targets, installed as oq.backends: one TOML data file per target (see README.md here)."""
