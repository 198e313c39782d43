"""The vision encoder's share of the memory plan (a vision-language model's actor).

Its weights are part of ``ModelArchitecture.num_parameters`` (masters, the reference's and
the rollout's copies count them as any weight). Frozen (``actor.freeze_vision_tower``, the
default) it has no gradients and no AdamW state, and its forward in the update keeps no
activations for a backward: only its features and one block's working set at a time.
Trained, autograd keeps every block's activations for every patch of the micro-batch's
images. Either way autocast casts its linear weights to the compute dtype.
"""

from __future__ import annotations

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.trainer.plan.memory_items import UPDATE, MemoryItem, PlanOptions


def encoder_parameters(a: ModelArchitecture) -> int:
    return 0 if a.vision is None else a.vision.num_parameters()


def trained_encoder_parameters(a: ModelArchitecture, o: PlanOptions) -> int:
    """The encoder's weights the optimizer steps: none when frozen or under LoRA (which
    adapts the language model only, learners/lora.py)."""
    frozen = o.freeze_vision_tower or o.lora_rank > 0
    return 0 if frozen else encoder_parameters(a)


def block_activation_elements(a: ModelArchitecture) -> int:
    """Elements a vision block keeps per patch for its backward: its input, two norms' outputs,
    q/k/v, the attention's output, the residual, and the SwiGLU MLP's gate, up and product."""
    e, i = a.vision.hidden_size, a.vision.intermediate_size
    return 6 * e + 3 * i


def vision_items(a: ModelArchitecture, o: PlanOptions) -> list[MemoryItem]:
    """The encoder's activations in the update at o.image_patches patches a micro-batch."""
    if a.vision is None or o.image_patches == 0:
        return []
    patches, spec = o.image_patches, a.vision
    features = patches // spec.merge_unit * spec.out_hidden_size
    trained = trained_encoder_parameters(a, o) > 0
    blocks = spec.depth if trained else 1  # frozen: one block's working set at a time
    elements = patches * blocks * block_activation_elements(a) + features
    how = "every block kept" if trained else "frozen: one block at a time"
    return [MemoryItem(f"vision encoder activations ({patches:,} patches, {how})",
                       elements * o.compute_bytes, (UPDATE,))]  # fmt: skip


def image_patches(a: ModelArchitecture, micro_batch_tokens: int, prompt_share: float) -> int:
    """At most this many patches in an actor micro-batch: every prompt token an image token
    (prompt_share: the prompts' share of the tokens), each merge_unit patches."""
    if a.vision is None:
        return 0
    return int(micro_batch_tokens * prompt_share) * a.vision.merge_unit
