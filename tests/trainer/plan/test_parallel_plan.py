"""The parallel memory plan, pinned against hand computation (the arithmetic in comments),
and the layout it recommends for the large cases of docs/parallelism.md."""

import pytest

from hybridflow.models.plan_shapes import shape_of
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import parallel_plan as pp
from hybridflow.trainer.plan.parallel_choice import recommend, training_layouts, why_nothing_fits

GIB = 2**30
LLAMA70 = shape_of(PRESETS["llama3.1-70b"])
DEEPSEEK = shape_of(PRESETS["deepseek-v3"])


def _item(plan, prefix):
    (item,) = [i for i in plan.items if i.name.startswith(prefix)]
    return item.gpu_bytes


def test_llama_70b_on_16_gpus_at_tensor_parallel_8():
    # Llama-3.1-70B: hidden 8192, 80 layers, 64 heads, 8 KV heads of 128, MLP 28672, vocab
    # 128256, untied. A layer's attention: q, o 8192² each, k, v 8192 × 1024 each, 2 norms:
    # 2 × 67,108,864 + 2 × 8,388,608 + 16,384 = 151,011,328; MLP 3 × 8192 × 28672 =
    # 704,643,072; embeddings 2 × 128256 × 8192 = 2,101,346,304; + the final norm 8,192:
    # P = 80 × 855,654,400 + 2,101,346,304 + 8,192 = 70,553,706,496.
    assert LLAMA70.total_params == 70_553_706_496
    o = pp.ParallelSetup(gpu_bytes=80 * GIB, world=16, tp=8, rollout_tp=8, max_seq_len=5120,
                         samples_per_step=1024, micro_batch_tokens=16384, rollout_max_seqs=256,
                         gpu_memory_utilization=0.9)  # fmt: skip
    plan = pp.build_parallel_plan(LLAMA70, o)
    # fp32 masters over all 16 GPUs: P // 16 = 4,409,606,656 parameters × 4 bytes
    assert _item(plan, "actor weights") == 17_638_426_624
    assert _item(plan, "actor optimizer state") == 2 * 17_638_426_624
    assert _item(plan, "actor gradients") == 17_638_426_624
    # the rollout's copy at tp 8: every weight but the final norm / 8 =
    # (70,553,706,496 − 8,192) // 8 = 8,819,212,288 parameters × 2 bytes
    assert _item(plan, "rollout weights") == 17_638_424_576
    # activations per token: 80 × (4 × 8192 + (2 × 8192 + 2 × 1024) / 8 + 4 × 28672 / 8)
    # + 3 × 8192 = 80 × 49,408 + 24,576 = 3,977,216 elements, × 2 bytes × 16,384 tokens
    assert _item(plan, "actor activations") == 3_977_216 * 2 * 16384
    # KV cache: 80 layers × 2 × 1024 × 2 bytes / 8 ranks = 40,960 bytes a token, 209,715,200
    # a 5,120-token sequence. Free at generation: 80 GiB − (weights + AdamW + rollout copy
    # = 17,638,426,624 × 3 + 17,638,424,576 = 70,553,704,448) = 15,345,641,472; × 0.9 =
    # 13,811,077,324, less the workspace (256 × 16,032 × 6 + 16,384 × (4 × 3584 + 8 × 8192)
    # × 2 = 2,641,870,848) = 11,169,206,476 → 53 sequences.
    assert _item(plan, "rollout workspace") == 2_641_870_848
    assert plan.kv.sequences == 53 and plan.kv.wave == 512  # 1,024 samples / 2 replicas
    # reshard: its rollout shard less the 1/16 of it it holds (17,638,424,576 // 16 =
    # 1,102,401,536) = 16,536,023,040 bytes; 16 GPUs span two nodes: the network, 50 GB/s
    assert plan.reshard.bytes_in == 16_536_023_040
    assert plan.reshard.seconds == pytest.approx(16_536_023_040 / 50e9)
    assert plan.phase_bytes(pp.UPDATE) > 80 * GIB  # 121 GiB of activations alone: no fit


def test_deepseek_v3_on_96_gpus_tp8_ep4_rollout_tp8_ep32():
    # DeepSeek-V3 (the runtime preset): attention per layer (MLA) = q_a 7168 × 1536 + 1536, q_b 1536 ×
    # 128 × 192, kv_a 7168 × 576 + 512, kv_b 512 × 128 × 256, o 16384 × 7168, 2 norms =
    # 11,011,584 + 37,748,736 + 4,129,280 + 16,777,216 + 117,440,512 + 14,336 = 187,121,664.
    # Dense: 61 × that + 3 × 396,361,728 (MLP 18432) + 58 × 45,875,456 (shared expert, router
    # and its score-correction buffer) + 1,853,358,080 (embeddings) = 17,117,641,216; routed experts: 58 × 256 ×
    # 44,040,192 = 653,908,770,816; + final norm 7,168: 671,026,419,200.
    assert not DEEPSEEK.plan_only and DEEPSEEK.total_params == 671_026_419_200
    assert DEEPSEEK.routed_params == 653_908_770_816
    o = pp.ParallelSetup(gpu_bytes=96 * 10**9, world=96, tp=8, ep=4, rollout_tp=8,
                         rollout_ep=32, param_offload=True, gradient_checkpointing=True,
                         max_seq_len=5120, samples_per_step=768, rollout_max_seqs=256)  # fmt: skip
    plan = pp.build_parallel_plan(DEEPSEEK, o)
    # rollout copy: dense // 8 = 2,139,705,152 + experts // 32 = 20,434,649,088 → × 2 bytes
    assert _item(plan, "rollout weights") == 45_148_708_480
    # the largest gathered unit: a sparse layer, (187,121,664 + 45,875,456) // 8 + 256 ×
    # 44,040,192 // (8 × 4) = 29,124,640 + 352,321,536 = 381,446,176; two in flight in bf16
    assert _item(plan, "actor gathered layers") == 2 * 381_446_176 * 2
    assert _item(plan, "actor weights") == 0  # offloaded: on the host
    # MLA's latent cache (512 + 64) is whole on every tensor-parallel rank: 61 × 576 × 2
    assert pp.kv_bytes_per_token(DEEPSEEK, 8, 2) == 70_272
    # reshard: 45,148,708,480 − 45,148,708,480 // 96 (470,299,046) = 44,678,409,434
    assert plan.reshard.bytes_in == 44_678_409_434
    assert plan.kv.wave == 64  # 768 samples / 12 replicas


def test_the_recommendation_for_llama_70b_on_16_gpus_of_80_gib():
    base = pp.ParallelSetup(gpu_bytes=80 * GIB, world=16, max_seq_len=5120, samples_per_step=1024,
                            micro_batch_tokens=16384, rollout_max_seqs=256,
                            gpu_memory_utilization=0.9, reference=True)  # fmt: skip
    advice = recommend(LLAMA70, base)
    # fp32 masters + AdamW + gradients are 16 bytes × 70.6 B / 16 = 65.7 GiB a GPU before
    # any activation or rollout copy (16.4 GiB at rollout tp 8): they go to the host
    assert advice.plan is not None
    assert "actor.param_offload=true" in advice.changes
    assert "model.gradient_checkpointing=true" in advice.changes
    assert "rollout.tensor_parallel_size=8" in advice.changes
    assert pp.build_parallel_plan(LLAMA70, advice.plan.setup).kv.sequences >= 1


def test_when_nothing_fits_the_plan_says_what_and_why():
    base = pp.ParallelSetup(gpu_bytes=24 * GIB, world=2, max_seq_len=5120, samples_per_step=64,
                            micro_batch_tokens=16384)  # fmt: skip
    advice = recommend(LLAMA70, base)
    assert advice.plan is None
    text = why_nothing_fits(advice.closest)
    assert text.startswith("nothing fits on 2 GPUs of 24.0 GiB: the closest layout")
    assert "GiB usable" in text and "more GPUs, larger GPUs" in text


def test_candidates_respect_the_model_and_the_devices():
    qwen235 = shape_of(PRESETS["qwen3-235b-a22b"])  # 4 KV heads: tp at most 4
    layouts = training_layouts(qwen235, 32)
    assert {tp for tp, _, _ in layouts} == {1, 2, 4}
    assert all(ep % sp == 0 and (32 // tp) % ep == 0 for tp, sp, ep in layouts if ep > 1)
