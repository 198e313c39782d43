"""Speculative decoding that keeps the sampling distribution exact: drafts with no second
model (drafts.py), verified k tokens a pass beside plain rows (verify.py), accepted by
speculative sampling (acceptance.py)."""

SPECULATIVE_METRICS = "speculative_metrics"
"""Batch.meta key of a rollout's speculation metrics (verify.SpeculationStats.metrics)."""
