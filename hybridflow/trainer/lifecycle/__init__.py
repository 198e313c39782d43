"""A run's life: setup and preflight checks, the run lock, stop requests, resume, checkpoints, saving and export."""
