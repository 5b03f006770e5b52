"""The configuration's error, below every layer that raises it (the key table, the samplers' refusals,
the configuration, the core's checks of a metric)."""


class ConfigError(ValueError):
    """A run configuration value is missing, unknown or out of range."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, damaged or belongs to another run (one line, naming the file)."""
