"""The training loops: the RL step and its stages, the roles they call, async rollout, evaluation, SFT and the warm start."""
