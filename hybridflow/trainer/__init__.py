"""The RL and SFT loops, metrics, loggers, checkpoints and validation."""
