"""Token mixers, one file per kind (models/layer_spec.MIXER_KINDS)."""
