"""From hidden states to what RL needs: log-probs and entropy (chunked or fused tiles of tokens x vocabulary, their Triton kernels) and sequence scores."""
