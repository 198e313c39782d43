"""The layout's shares in the one memory plan, pinned against hand computation (the
arithmetic in comments), and the reshard estimate."""

import pytest

from hybridflow.models.plan_shapes import shape_of
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan import parallel_plan as pp
from hybridflow.trainer.plan.memory_plan import PlanOptions
from hybridflow.trainer.plan.parallel_choice import training_layouts

GIB = 2**30
LLAMA70 = PRESETS["llama3.1-70b"]
DEEPSEEK = PRESETS["deepseek-v3"]


def _item(plan, prefix):
    (item,) = [i for i in plan.items if i.name.startswith(prefix)]
    return item.gpu_bytes


def test_llama_70b_on_16_gpus_at_tensor_parallel_8():
    # Llama-3.1-70B: hidden 8192, 80 layers, 64 heads, 8 KV heads of 128, MLP 28672, vocab
    # 128256, untied. A layer's attention: q, o 8192² each, k, v 8192 × 1024 each, 2 norms:
    # 2 × 67,108,864 + 2 × 8,388,608 + 16,384 = 151,011,328; MLP 3 × 8192 × 28672 =
    # 704,643,072; embeddings 2 × 128256 × 8192 = 2,101,346,304; + the final norm 8,192:
    # P = 80 × 855,654,400 + 2,101,346,304 + 8,192 = 70,553,706,496.
    assert LLAMA70.num_parameters() == 70_553_706_496
    o = PlanOptions(train_gpus=16, tp=8, rollout_tp=8, rollout_max_seq_len=5120,
                    micro_batch_tokens=16384, micro_batches=4, rollout_max_seqs=256,
                    gpu_memory_utilization=0.9, gpu_bytes=80 * GIB)  # fmt: skip
    plan = mp.build_plan("llama3.1-70b", LLAMA70, o)
    # fp32 masters over all 16 GPUs: P // 16 = 4,409,606,656 parameters × 4 bytes
    assert _item(plan, "actor weights") == 17_638_426_624
    assert _item(plan, "optimizer state") == 2 * 17_638_426_624
    assert _item(plan, "actor gradients") == 17_638_426_624
    # FSDP2 keeps a rank's 1/8 gathered over the mini-batch: P // 8 = 8,819,213,312 in bf16,
    # and its unsharded fp32 gradients until the last micro-batch
    assert _item(plan, "actor gathered weights") == 8_819_213_312 * 2
    assert _item(plan, "actor unsharded gradients") == 8_819_213_312 * 4
    # the rollout's copy at tp 8: every weight but the final norm / 8, the layers' norms
    # whole on every rank (80 × 2 × 8,192 = 1,310,720): (70,553,706,496 − 8,192 − 1,310,720)
    # // 8 + 1,310,720 = 8,819,048,448 + 1,310,720 = 8,820,359,168 parameters × 2 bytes
    assert _item(plan, "rollout weights") == 17_640_718_336
    # activations per token: 80 × (4 × 8192 + (2 × 8192 + 2 × 1024) / 8 + 4 × 28672 / 8)
    # + 3 × 8192 = 80 × 49,408 + 24,576 = 3,977,216 elements, × 2 bytes × 16,384 tokens
    assert _item(plan, "activations") == 3_977_216 * 2 * 16384
    # KV: 80 layers × 2 × 1024 × 2 bytes / 8 ranks = 40,960 bytes a token, a 64-token block
    # 2,621,440 bytes; before generation the GPU holds masters, AdamW and the rollout copy
    assert pp.kv_bytes_per_token(shape_of(LLAMA70), 8, 2) == 40_960
    assert plan.phase_bytes(mp.UPDATE) > 80 * GIB  # the gathered model alone: no fit


def test_param_offload_gathers_layer_by_layer():
    """DeepSeek-V3 on 96 GPUs, tp 8 × ep 4 (priced, not run: tp on experts is not built)."""
    o = PlanOptions(train_gpus=96, tp=8, ep=4, param_offload=True, gradient_checkpointing=True,
                    rollout_max_seq_len=5120, rollout_max_seqs=256, micro_batches=4,
                    gpu_bytes=96 * 10**9)  # fmt: skip
    plan = mp.build_plan("deepseek-v3", DEEPSEEK, o)
    # the largest gathered unit: a sparse layer, (187,121,664 + 45,875,456) // 8 + 256 ×
    # 44,040,192 // (8 × 4) = 29,124,640 + 352,321,536 = 381,446,176; two in flight in bf16,
    # one layer's fp32 gradients before the reduce-scatter; no unsharded copy of the model
    assert mp.gathered_unit_parameters(DEEPSEEK, 8, 4) == 381_446_176
    assert _item(plan, "actor gathered layers") == 2 * 381_446_176 * 2
    assert _item(plan, "actor one layer's gradients") == 381_446_176 * 4
    assert not [i for i in plan.items if "unsharded" in i.name or "gathered weights" in i.name]
    assert _item(plan, "actor weights") == 0  # offloaded: on the host


def test_the_latent_cache_is_whole_on_every_rollout_rank():
    # MLA's latent (512 + 64) in 61 layers × 2 bytes, on every tensor-parallel rank
    assert pp.kv_bytes_per_token(shape_of(DEEPSEEK), 8, 2) == 70_272
    one = PlanOptions(rollout_max_seq_len=64, rollout_max_seqs=4)
    eight = PlanOptions(rollout_max_seq_len=64, rollout_max_seqs=4, rollout_tp=8)
    whole = [i for i in mp.build_plan("v3", DEEPSEEK, one).items if i.name.startswith("KV")]
    split = [i for i in mp.build_plan("v3", DEEPSEEK, eight).items if i.name.startswith("KV")]
    assert whole[0].gpu_bytes == split[0].gpu_bytes


def test_the_reshard_estimate():
    # Llama-70B colocated on 16 GPUs into rollout tp 8: its shard 17,640,718,336 bytes less
    # the 1/16 its own training shard holds (1,102,544,896) = 16,538,173,440; 16 GPUs span
    # two nodes: the network, 50 GB/s
    r = pp.reshard(shape_of(LLAMA70), 16, 8)
    assert r.bytes_in == 16_538_173_440
    assert r.seconds == pytest.approx(16_538_173_440 / 50e9) and r.link.startswith("network")


def test_candidates_respect_the_model_and_the_devices():
    qwen235 = shape_of(PRESETS["qwen3-235b-a22b"])  # 4 KV heads: tp at most 4
    layouts = training_layouts(qwen235, 32)
    assert {tp for tp, _, _ in layouts} == {1, 2, 4}
    assert all(ep % sp == 0 and (32 // tp) % ep == 0 for tp, sp, ep in layouts if ep > 1)


@pytest.mark.parametrize(
    "preset",
    ["tiny", "tiny-moe", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-hybrid", "tiny-hybrid-moe"],
)
def test_the_rollout_share_is_what_a_tensor_parallel_rank_holds(preset):
    """rollout_share at tp 2 counts the parameters (and DeepSeek's score correction) of one
    rank's engine shard exactly: half of each split tensor (parallel/blocks.rollout_shard_dim),
    the rest whole (norms, routers, o_proj's bias, MLA's latent projection and q's
    down-projection with their norms), less the final norm the plan leaves out."""
    from hybridflow.models import build_model
    from hybridflow.parallel.blocks import rollout_shard_dim

    arch = PRESETS[preset] if preset in PRESETS else PRESETS["tiny-hybrid"].replace(
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
    )  # fmt: skip  # Qwen3.5-MoE's layers: a gated shared expert beside the routed ones
    model = build_model(arch, seed=0)
    saved = set(model.state_dict())
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in saved)]
    held = sum(t.numel() // (1 if rollout_shard_dim(name) is None else 2) for name, t in named)
    assert pp.rollout_share(shape_of(arch), 2, 1) == held - arch.hidden_size
