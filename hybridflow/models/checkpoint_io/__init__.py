"""Hugging Face checkpoints in and out: reading safetensors into our decoder (per-expert or packed experts, finite weights), the checks `validate` shares with loading, and transformers' fallback."""
