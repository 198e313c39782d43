"""The engine's own weight copies: the fused projections of the triton backend (fused.py) and
the storage a rollout frees between generation and the next weight sync (release.py)."""
