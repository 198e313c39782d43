"""The memory plan of a vision-language actor: the encoder's weights counted, its gradients
and AdamW state only when it trains, its activations at the micro-batch's image patches."""

import dataclasses

from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_plan import PlanOptions
from hybridflow.trainer.plan.memory_vision import block_activation_elements, image_patches

VL7B = PRESETS["qwen2.5-vl-7b"]
ENCODER = VL7B.vision.num_parameters()
# a micro-batch of 16,384 tokens whose prompts (1024 of 1024 + 2048 tokens) are all image
# tokens: 16,384 / 3 = 5,461 image tokens of 2 x 2 patches
PATCHES = image_patches(VL7B, 16384, 1024 / 3072)


def _items(**options):
    base = PlanOptions(micro_batch_tokens=16384, rollout_max_seqs=64, rollout_max_seq_len=3072,
                       image_patches=PATCHES)  # fmt: skip
    plan = mp.build_plan("qwen2.5-vl-7b", VL7B, dataclasses.replace(base, **options))
    return {item.name.split(" (")[0]: item for item in plan.items}


def test_a_frozen_encoder_has_no_gradients_or_optimizer_state():
    assert PATCHES == 5461 * 4 and ENCODER > 600_000_000  # the 7B's 32-block encoder
    frozen, trained = _items(), _items(freeze_vision_tower=False)
    for name, per_parameter in (("actor gradients", 4), ("optimizer state", 8)):
        assert trained[name].gpu_bytes - frozen[name].gpu_bytes == per_parameter * ENCODER
    # its weights are there either way, and autocast casts them either way
    assert frozen["actor weights"].gpu_bytes == trained["actor weights"].gpu_bytes
    assert frozen["actor weights"].gpu_bytes == 4 * VL7B.num_parameters()


def test_the_encoders_activations_are_planned_at_the_micro_batchs_patches():
    spec = VL7B.vision
    features = PATCHES // 4 * spec.out_hidden_size
    block = block_activation_elements(VL7B)  # 6 * 1280 + 3 * 3420 = 17,940 a patch
    assert block == 17_940
    frozen, trained = _items(), _items(freeze_vision_tower=False)
    activations = "vision encoder activations"
    assert frozen[activations].gpu_bytes == 2 * (PATCHES * block + features)  # one block
    assert trained[activations].gpu_bytes == 2 * (PATCHES * 32 * block + features)
    assert activations not in _items(image_patches=0)  # text-only batches


def test_lora_leaves_the_encoder_frozen_whatever_freeze_vision_tower_says():
    lora = _items(lora_rank=8, freeze_vision_tower=False)
    activations = "vision encoder activations"
    assert lora[activations].gpu_bytes == _items()[activations].gpu_bytes  # one block's
    assert mp.trainable_parameters(VL7B, PlanOptions(lora_rank=8, freeze_vision_tower=False)) \
        == mp.lora_parameters(VL7B, 8, PlanOptions().lora_targets)  # fmt: skip


def test_the_vision_language_presets_have_the_published_sizes():
    # Qwen2.5-VL-7B-Instruct 8.29 B, Qwen2.5-VL-72B-Instruct 73.4 B (encoders of 0.68 / 0.70 B)
    for name, total, encoder in (("qwen2.5-vl-7b", 8.292e9, 0.677e9),
                                 ("qwen2.5-vl-72b", 73.41e9, 0.705e9)):  # fmt: skip
        a = PRESETS[name]
        assert abs(a.num_parameters() / total - 1) < 1e-3, name
        assert abs(a.vision.num_parameters() / encoder - 1) < 1e-3, name


def test_a_sequence_parallel_rank_encodes_the_whole_images_of_its_groups_micro_batch():
    """Ulysses: each rank runs the encoder on the images of the group's micro-batch, sp times
    a rank's tokens (learners/sharding/sequence_shard.py)."""
    from hybridflow.config import load_config, validate
    from hybridflow.trainer.plan.memory_from_config import plan_options

    def patches(sp: int) -> int:
        cfg = load_config(None, ["model.path=qwen2.5-vl-7b", "trainer.n_gpus_per_node=8",
                                 "trainer.backend=local", "trainer.device=cuda",
                                 "data.image_key=images", "actor.max_tokens_per_gpu=16384",
                                 f"actor.sequence_parallel_size={sp}"])  # fmt: skip
        return plan_options(cfg, validate(cfg, planning=True), None).image_patches

    one = patches(1)
    assert one > 0 and 0 <= patches(2) - 2 * one <= VL7B.vision.merge_unit  # rounding
