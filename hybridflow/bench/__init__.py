"""`hybridflow bench`: engine rollout, time to first token, agent episodes, whole GRPO steps."""
