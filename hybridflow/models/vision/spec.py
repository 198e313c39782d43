"""The shape of a vision encoder and where its features go, read from config.json.

Kept apart from the encoder's module (no torch import): ModelArchitecture holds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Encoder kinds (one module each under models/vision/):
#   qwen2_5_vl  RMSNorm blocks with a SwiGLU MLP, windowed attention except on
#               fullatt_block_indexes, 2-D RoPE over (row, column), an MLP patch merger
#   qwen3_5     (Qwen3.5's, Qwen3-VL's without DeepStack) LayerNorm blocks with an
#               fc1/act/fc2 MLP, full attention in every block, the same 2-D RoPE plus a
#               learned position table resampled to each image's grid, a LayerNorm merger
ENCODER_KINDS = ("qwen2_5_vl", "qwen3_5")
# vision_config.model_type of each kind (what config.json names and we write)
HF_MODEL_TYPES = {"qwen2_5_vl": "qwen2_5_vl_vision", "qwen3_5": "qwen3_5_vision"}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")


@dataclass(frozen=True)
class VisionSpec:
    """A vision encoder (field names follow HF's ``vision_config``) and the token ids of the
    language model its features replace (``image_token_id``: one per merged patch)."""

    kind: str = "qwen2_5_vl"
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    """Pixels a window of windowed attention spans on each side."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Blocks that attend over the whole image; the others within windows."""
    out_hidden_size: int = 3584
    """The language model's hidden size (the merger's output)."""
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: int = 4
    num_position_embeddings: int = 0
    """qwen3_5: entries of the learned square position table (side² of them)."""
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        if self.kind not in ENCODER_KINDS:
            raise ValueError(f"vision encoder {self.kind!r} is not one of {ENCODER_KINDS}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act={self.hidden_act!r} is not one of "
                             f"{ACTIVATIONS}")  # fmt: skip
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision_config.hidden_size={self.hidden_size} must split into num_heads="
                f"{self.num_heads} heads of a multiple of 4 (2-D RoPE turns quarters)"
            )
        if self.kind == "qwen3_5":
            side = math.isqrt(self.num_position_embeddings)
            if self.num_position_embeddings <= 0 or side * side != self.num_position_embeddings:
                raise ValueError(f"vision_config.num_position_embeddings="
                                 f"{self.num_position_embeddings} must be a positive square "
                                 "(a square table of learned positions)")  # fmt: skip
            return
        window = self.spatial_merge_size * self.patch_size
        if self.window_size < window:
            raise ValueError(
                f"vision_config.window_size={self.window_size} must be at least "
                f"spatial_merge_size * patch_size = {window}"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision_config.fullatt_block_indexes {bad} are not blocks of "
                             f"depth={self.depth}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_elements(self) -> int:
        """Values of one flattened patch (a pixel_values row): C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size**2

    def num_parameters(self) -> int:
        """Weights of the encoder (equals sum(p.numel()) of its module)."""
        e, i = self.hidden_size, self.intermediate_size
        merged = e * self.merge_unit
        merger = merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        if self.kind == "qwen3_5":
            # two LayerNorms, qkv and proj with biases, fc1/fc2 with biases; the patch
            # embedding's bias, the position table; the merger's LayerNorm
            block = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (2 * e * i + i + e)
            embed = self.patch_elements * e + e + self.num_position_embeddings * e
            return embed + self.depth * block + 2 * e + merger
        # two norms, qkv and proj with biases, the SwiGLU MLP with biases
        block = 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (3 * e * i + 2 * i + e)
        return self.patch_elements * e + self.depth * block + e + merger

    @classmethod
    def from_hf(cls, vision: dict[str, Any], top: dict[str, Any],
                kind: str = "qwen2_5_vl") -> VisionSpec:  # fmt: skip
        """From a config.json's ``vision_config`` and its top level (the token ids), for the
        encoder ``kind`` its family holds (the defaults of its published configs where a key
        is left out)."""
        rope = (
            vision.get("rope_parameters") if isinstance(vision.get("rope_parameters"), dict) else {}
        )
        defaults = cls() if kind == "qwen2_5_vl" else QWEN3_5_DEFAULTS
        ids = {key: int(top[key]) for key in ("image_token_id", "video_token_id",
               "vision_start_token_id", "vision_end_token_id") if top.get(key) is not None}  # fmt: skip
        return cls(
            kind=kind,
            depth=int(vision.get("depth", defaults.depth)),
            hidden_size=int(vision.get("hidden_size", defaults.hidden_size)),
            intermediate_size=int(vision.get("intermediate_size", defaults.intermediate_size)),
            num_heads=int(vision.get("num_heads", defaults.num_heads)),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            patch_size=int(vision.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            window_size=int(vision.get("window_size", defaults.window_size)),
            fullatt_block_indexes=tuple(
                int(i) for i in vision.get("fullatt_block_indexes", defaults.fullatt_block_indexes)
            ),  # fmt: skip
            out_hidden_size=int(vision.get("out_hidden_size", defaults.out_hidden_size)),
            hidden_act=str(vision.get("hidden_act", defaults.hidden_act)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            tokens_per_second=int(vision.get("tokens_per_second", 4)),
            num_position_embeddings=int(
                vision.get("num_position_embeddings", defaults.num_position_embeddings)
            ),
            **ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` entry of config.json: the sizes every kind has, then its own
        (Qwen2.5-VL's windows, Qwen3.5's position table)."""
        hf: dict[str, Any] = {
            "model_type": HF_MODEL_TYPES[self.kind],
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "out_hidden_size": self.out_hidden_size,
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            "initializer_range": 0.02,
        }
        if self.kind == "qwen3_5":
            hf["num_position_embeddings"] = self.num_position_embeddings
        else:
            hf.update(window_size=self.window_size, tokens_per_second=self.tokens_per_second,
                      fullatt_block_indexes=list(self.fullatt_block_indexes))  # fmt: skip
        return hf

    def token_ids_to_hf(self) -> dict[str, int]:
        return {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
                "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id}  # fmt: skip


# Qwen3.5's vision_config defaults (transformers' Qwen3_5VisionConfig: the published encoder
# of every size), where a config.json leaves a key out
QWEN3_5_DEFAULTS = VisionSpec(
    kind="qwen3_5", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
    patch_size=16, out_hidden_size=3584, hidden_act="gelu_pytorch_tanh",
    num_position_embeddings=2304, image_token_id=248056, video_token_id=248057,
    vision_start_token_id=248053, vision_end_token_id=248054,
)  # fmt: skip
