"""The fp8 rollout: the e4m3 format and activations quantized per row (e4m3.py), how a
projection's weight is quantized, with the engine's scales or the FP8 trainer's recipe
(weight_scales.py), and the matmuls over those copies (matmul.py)."""
