"""The RL and SFT loops (``rl_loop``, ``sft_loop``), their stages, metrics, loggers,
checkpoints and evaluation. The models they train live in ``hybridflow.learners``."""
