"""What a run reports: metrics, loggers, the step profiler, traces, rollout dumps."""
