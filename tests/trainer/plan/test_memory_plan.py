"""The memory plan's arithmetic on known shapes, by hand, and against measured peaks."""

import dataclasses

import pytest
import torch

from hybridflow.engine.cache.workspace import sampling_bytes_per_row
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_plan import GIB, PlanOptions
from hybridflow.trainer.plan.memory_render import render

QWEN05 = PRESETS["qwen2.5-0.5b"]
# qwen2.5-0.5b: h = 896, i = 4864, 24 layers, 14 q heads and 2 kv heads of 64 (q = 896,
# kv = 128), V = 151,936, tied embeddings, q/k/v bias.
# per layer: q, o 896·896 = 802,816 each; k, v 896·128 = 114,688 each; biases 896 + 2·128;
#   attention 1,836,160; MLP 3·896·4864 = 13,074,432; norms 2·896 -> 14,912,384
# embeddings 151,936·896 = 136,134,656; total 24·14,912,384 + 896 + 136,134,656
P = 494_032_768
LINEAR = 24 * (1_836_160 + 13_074_432)  # 357,854,208: what autocast casts to bf16
VOCAB_MATRIX = 136_134_656
# The engine's reserve (engine/cache/workspace.py) at 2,000 decode rows: 22 bytes a row and
# vocabulary entry for sampling, and a 16,384-token prefill chunk's 8h + q/k/v/out
# (2·14 + 2·2 heads of 64) + 4i elements of 2 bytes
RESERVE_2000_ROWS = 2000 * 151936 * 22 + 16384 * (8 * 896 + 32 * 64 + 4 * 4864) * 2


def items(plan):
    return {item.name: item for item in plan.items}


def test_full_fine_tune_of_the_0_5b_on_one_gpu_by_hand():
    options = PlanOptions(micro_batch_tokens=16384, rollout_max_seqs=64, rollout_max_seq_len=1024)
    plan = mp.build_plan("qwen2.5-0.5b", QWEN05, options)
    got = items(plan)
    assert QWEN05.num_parameters() == P
    assert got["actor weights (fp32 masters)"].gpu_bytes == 4 * P  # 1.84 GiB
    assert got["actor compute copy (bf16)"].gpu_bytes == 2 * (LINEAR + VOCAB_MATRIX)
    assert got["actor gradients (fp32)"].gpu_bytes == 4 * P
    assert got["optimizer state (AdamW, fp32)"].gpu_bytes == 8 * P  # exp_avg + exp_avg_sq
    # activations per token and layer: 4h + 2q + 2kv + 4i = 3584 + 1792 + 256 + 19456 = 25,088
    # elements; 24 layers + the head's 3h = 604,800 elements, 1,209,600 bytes a token
    assert got["activations (16,384 tokens)"].gpu_bytes == 16384 * 1_209_600  # 18.5 GiB
    # head: a 4096-token chunk of bf16 logits + fp32 and bf16 [V, H] lm_head gradients
    head = 4096 * 151936 * 2 + VOCAB_MATRIX * (4 + 2)
    assert got["log-prob head (logits chunk, lm_head gradient)"].gpu_bytes == head
    # fp32 masters: the engine cannot read them, it holds a bf16 copy
    assert got["rollout weights (bf16 copy)"].gpu_bytes == 2 * P
    # K and V: 2 · 24 layers · 64 tokens · 2 kv heads · 64 · 2 bytes = 768 KiB a block of the
    # paged cache; 1024 / 64 = 16 blocks a sequence, all 64 sequences' 1,024 blocks and the
    # scratch block (GPU size unknown: all of max_num_seqs)
    kv = got["KV cache (1,024 + 1 blocks: 64 × 1,024 tokens)"]
    assert kv.gpu_bytes == 1025 * 786_432 and plan.kv_slots == 64
    assert kv.note == "64 tokens a block, 16 blocks a 1,024-token sequence"
    # the optimizer step holds masters, gradients and AdamW state, and the rollout's copy
    assert plan.phase_bytes(mp.STEP) == 4 * P + 4 * P + 8 * P + 2 * P
    phase, peak = plan.peak()
    assert phase == mp.UPDATE and peak > plan.phase_bytes(mp.GENERATE)
    assert plan.host_bytes() == 0


def test_gradient_checkpointing_keeps_each_layer_input_and_one_layer():
    # 24 layers · h = 21,504 elements + one layer's 25,088 + the head's 2,688 = 49,280
    assert mp.activation_bytes_per_token(QWEN05, gradient_checkpointing=True) == 2 * 49_280
    qwen3 = PRESETS["qwen3-0.6b"]  # q/k-norm keeps its inputs too: q + kv = 2048 + 1024
    plain = mp.activation_bytes_per_token(qwen3.replace(qk_norm=False), False)
    assert mp.activation_bytes_per_token(qwen3, False) - plain == 28 * 2 * (2048 + 1024)


def test_fsdp_shards_weights_gradients_and_state_and_accumulates_unsharded():
    options = PlanOptions(train_gpus=4, micro_batches=3, micro_batch_tokens=8192)
    got = items(mp.build_plan("qwen2.5-0.5b", QWEN05, options))
    assert got["actor weights (fp32 masters)"].gpu_bytes == 4 * P // 4
    assert got["optimizer state (AdamW, fp32)"].gpu_bytes == 8 * P // 4
    # every unit stays gathered in bf16 for the mini-batch (accumulate_unsharded)
    assert got["actor gathered weights (bf16)"].gpu_bytes == 2 * P
    # three micro-batches: fp32 gradients stay whole until the last one reduce-scatters
    assert got["actor unsharded gradients (accumulating)"].gpu_bytes == 4 * P
    assert got["actor gradients (fp32)"].phases == (mp.STEP,)
    # FSDP2 or not, the engine holds a full bf16 copy on every GPU
    assert got["rollout weights (bf16 copy)"].gpu_bytes == 2 * P


def test_optimizer_offload_moves_masters_and_state_to_the_host_for_the_whole_run():
    on_gpu = mp.build_plan("q", QWEN05, PlanOptions())
    offloaded = mp.build_plan("q", QWEN05, PlanOptions(optimizer_offload=True))
    got = items(offloaded)
    master, state = got["actor master weights (fp32)"], got["optimizer state (AdamW, fp32)"]
    assert (master.gpu_bytes, master.host_bytes, master.phases) == (0, 4 * P, ())
    assert (state.gpu_bytes, state.host_bytes, state.phases) == (0, 8 * P, ())
    # the GPU keeps bf16 weights and bf16 gradients; autocast has nothing left to cast
    assert got["actor weights (bf16, masters on the host)"].gpu_bytes == 2 * P
    assert got["actor gradients (bf16)"].gpu_bytes == 2 * P
    assert "actor compute copy (bf16)" not in got
    # the embedding (151,936 × 896 = 136 M) is the largest bucket: two pinned bf16 buffers
    # and one fp32 gradient buffer of it, 8 bytes a parameter
    buffers = got["host step buffers (2 pinned bf16 + fp32 gradients)"]
    assert buffers.host_bytes == VOCAB_MATRIX * (2 + 2 + 4)
    assert offloaded.host_bytes() - on_gpu.host_bytes() == 12 * P + 8 * VOCAB_MATRIX
    # bf16 training weights on one GPU: the rollout reads them in place, no copy of its own
    assert got["rollout weights"].gpu_bytes == 0
    # every phase drops by at least the masters and the moments (12 bytes a parameter): the
    # step holds 2P of weights and 2P of gradients where it held 4P + 4P + 8P and a 2P copy
    for phase in (mp.GENERATE, mp.UPDATE, mp.STEP):
        assert on_gpu.phase_bytes(phase) - offloaded.phase_bytes(phase) >= 12 * P, phase
    assert offloaded.phase_bytes(mp.STEP) == 2 * P + 2 * P


def test_optimizer_offload_bucket_size_is_the_host_optimizers():
    from hybridflow.learners.host_optimizer import BUCKET_ELEMENTS

    assert mp.OFFLOAD_BUCKET_ELEMENTS == BUCKET_ELEMENTS


def test_param_offload_does_nothing_on_one_gpu_and_is_host_memory_on_two():
    one_gpu = items(mp.build_plan("q", QWEN05, PlanOptions(param_offload=True)))
    assert one_gpu["actor weights (fp32 masters)"].gpu_bytes == 4 * P
    two = mp.build_plan("q", QWEN05, PlanOptions(param_offload=True, train_gpus=2))
    got = items(two)
    assert got["actor weights (fp32 masters)"].gpu_bytes == 0
    assert got["actor weights (fp32 masters)"].host_bytes == 4 * P  # both ranks' halves
    assert got["optimizer state (AdamW, fp32)"].host_bytes == 8 * P
    assert two.phase_bytes(mp.STEP) == 2 * P  # only the rollout's copy: the host steps


def test_lora_trains_the_adapters_only_and_the_reference_is_the_actor():
    # rank 8 on all seven projections of a layer: 8 · (in + out) summed =
    # 8 · (2·896 + 2·(896 + 128) + 2·896 + 2·(896 + 4864) + (4864 + 896)) = 183,296
    assert mp.lora_parameters(QWEN05, 8, mp.LORA_TARGET_SHAPES) == 24 * 183_296
    options = PlanOptions(lora_rank=8, reference="actor")
    plan = mp.build_plan("q", QWEN05, options)
    got = items(plan)
    trainable = 24 * 183_296
    assert got["actor weights (fp32 masters)"].gpu_bytes == 4 * P  # base weights stay fp32
    assert got["optimizer state (AdamW, fp32)"].gpu_bytes == 8 * trainable
    assert got["actor gradients (fp32)"].gpu_bytes == 4 * trainable
    assert got["reference weights"].gpu_bytes == 0


def test_lora_count_matches_peft():
    pytest.importorskip("peft")
    from hybridflow.learners.lora import apply_lora
    from hybridflow.models import build_model

    model = build_model(PRESETS["tiny-4l"])
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mp.lora_parameters(PRESETS["tiny-4l"], 4, ("q_proj", "v_proj", "down_proj")) == trained


def test_rollout_reads_bf16_training_weights_in_place():
    plan = mp.build_plan("q", QWEN05, PlanOptions(master_bytes=2))  # model.dtype=bfloat16
    assert items(plan)["rollout weights"].gpu_bytes == 0
    assert "actor compute copy (bf16)" not in items(plan)  # no mixed precision, no casts


def test_slot_kv_cache_takes_its_fraction_of_what_generation_leaves_free():
    options = PlanOptions(gpu_bytes=40 * GIB, gpu_memory_utilization=0.5, kv_block_size=None,
                          rollout_max_seqs=2000, rollout_max_seq_len=1024)  # fmt: skip
    plan = mp.build_plan("q", QWEN05, options)
    # resident while generating: masters 4P + AdamW 8P + rollout copy 2P + fused copies
    fused = 24 * ((896 + 256) * 896 + 1152 + 2 * 4864 * 896) * 2
    assert mp.fused_copy_bytes(QWEN05, "all") == fused
    used = 14 * P + fused
    reserve = RESERVE_2000_ROWS
    slots = (int(0.5 * (40 * GIB - used)) - reserve) // 12_582_912 - 1
    assert plan.kv_slots == slots and 0 < slots < 2000  # the budget, not max_num_seqs, decides
    kv = next(i for i in plan.items if i.name.startswith("KV cache"))
    assert kv.gpu_bytes == (slots + 1) * 12_582_912
    assert kv.name == f"KV cache ({slots:,} + 1 slots × 1,024 tokens)"
    small = mp.build_plan("q", QWEN05, PlanOptions(gpu_bytes=8 * GIB, rollout_max_seqs=1024,
                                                   kv_block_size=None))  # fmt: skip
    assert small.kv_slots == 0  # 8 GiB: the update's resident items leave no slot
    assert items(small)["KV cache (no slot of 2,048 tokens fits)"].gpu_bytes == 0


def test_paged_kv_cache_takes_its_fraction_in_blocks():
    options = PlanOptions(gpu_bytes=40 * GIB, gpu_memory_utilization=0.5,
                          rollout_max_seqs=2000, rollout_max_seq_len=1000)  # fmt: skip
    plan = mp.build_plan("q", QWEN05, options)
    fused = 24 * ((896 + 256) * 896 + 1152 + 2 * 4864 * 896) * 2
    used, reserve = 14 * P + fused, RESERVE_2000_ROWS
    # 768 KiB blocks of 64 tokens, less the scratch block; 1,000 tokens round up to 16 blocks
    blocks = (int(0.5 * (40 * GIB - used)) - reserve) // 786_432 - 1
    assert plan.kv_slots == blocks // 16 and 0 < blocks < 2000 * 16
    kv = next(i for i in plan.items if i.name.startswith("KV cache"))
    assert kv.gpu_bytes == (blocks + 1) * 786_432
    assert kv.name == f"KV cache ({blocks:,} + 1 blocks: {blocks // 16:,} × 1,000 tokens)"
    # 32-token blocks: 32 a sequence (1,000 -> 1,024 positions), twice as many of half the size
    halves = mp.build_plan("q", QWEN05, dataclasses.replace(options, kv_block_size=32))
    assert halves.kv_slots == ((int(0.5 * (40 * GIB - used)) - reserve) // 393_216 - 1) // 32
    small = mp.build_plan("q", QWEN05, PlanOptions(gpu_bytes=8 * GIB, rollout_max_seqs=1024))
    assert small.kv_slots == 0  # 8 GiB: the update's resident items leave no block at all
    kv = items(small)["KV cache (no 2,048-token sequence fits)"]
    assert kv.gpu_bytes == 0 and kv.note == "64 tokens a block, 32 blocks a 2,048-token sequence"


@pytest.mark.parametrize(
    "preset, block_size, kv_fp8",
    [(preset, block, False) for preset in ("tiny", "tiny-hybrid") for block in (None, 16, 64)]
    + [("tiny", 16, True), ("tiny", 64, True)],
)
def test_the_plan_sizes_the_kv_cache_as_the_engine_allocates_it(
    block_size, preset, kv_fp8, monkeypatch
):
    """tiny: 2 layers of K/V; tiny-hybrid: 1 layer of K/V and a recurrent state per slot in
    3 layers (the slots' states taken first beside a paged cache, in each slot of a slot
    cache); an FP8 cache (rollout.engine.kv_cache_dtype=fp8, paged full attention only):
    e4m3 K/V and an fp32 scale a kv head, 2·2·2·(16 + 4) = 160 bytes a position of tiny
    against bf16's 256."""
    import torch

    from hybridflow.engine.cache import sizing

    arch = PRESETS[preset]
    state = arch.recurrent_state_bytes(2)
    reserve = mp.rollout_reserve_bytes(arch, PlanOptions(rollout_max_seqs=8))
    if kv_fp8:
        assert mp.kv_block_bytes(arch, 1, 2, fp8=True) == 160
    # budgets (bytes) from under one sequence to over all 8 of 100 tokens (7 blocks of 16)
    for kv_budget in (20_000, 100 * 512 - 1, 100 * 768, 8 * 112 * 256 + 7_000, 10**6):
        budget = kv_budget + 9 * state
        options = PlanOptions(gpu_bytes=budget + reserve, gpu_memory_utilization=1.0,
                              rollout_max_seqs=8, rollout_max_seq_len=100,
                              kv_block_size=block_size, kv_cache_fp8=kv_fp8)  # fmt: skip
        kv, sequences, _ = mp.kv_cache_item(arch, options, [])
        # the engine's automatic budget (a fraction of the device) with the reserve taken out
        monkeypatch.setattr(sizing, "cache_budget", lambda *args, budget=budget: budget)
        try:
            cache, _ = sizing.make_cache(arch, 8, 100, block_size, 1.0, reserve,
                                           torch.bfloat16, torch.device("cpu"),
                                           row_reserve_bytes=sampling_bytes_per_row(arch),
                                           kv_fp8=kv_fp8)  # fmt: skip
        except ValueError:  # the engine refuses: the plan says none fits
            assert sequences == 0 and kv.gpu_bytes == 0, budget
            continue
        assert (cache.scales is not None) == kv_fp8
        assert kv.gpu_bytes == cache.nbytes(), budget
        held = cache.num_slots if block_size is None else cache.num_blocks // -(-100 // block_size)
        assert sequences == min(held, 8) > 0, budget
        assert (cache.states is not None) == (state > 0)


# Peaks measured with torch.cuda.max_memory_allocated on one H200 (docs/performance.md,
# 2026-11-30), and the options of each workload.
MEASURED = [
    pytest.param(  # GRPO vs TRL, hybridflow defaults: 128 x 8 samples of 128 + 256 tokens
        "qwen2.5-0.5b", 16.1,
        dict(gradient_checkpointing=True, micro_batch_tokens=65536, micro_batches=6,
             rollout_max_seqs=1024, rollout_max_seq_len=384),
        id="grpo-1gpu",
    ),
    pytest.param(  # the same workload per GPU on 2 GPUs (FSDP2)
        "qwen2.5-0.5b", 13.3,
        dict(gradient_checkpointing=True, micro_batch_tokens=65536, micro_batches=3,
             train_gpus=2, rollout_max_seqs=512, rollout_max_seq_len=384),
        id="grpo-2gpu-fsdp",
    ),
    pytest.param(  # train_scaling.py: actor update only, 16,384-token micro-batches
        "qwen2.5-0.5b", 27.8, dict(micro_batch_tokens=16384, micro_batches=2),
        id="update-1gpu",
    ),
]  # fmt: skip


@pytest.mark.parametrize("model, measured_gib, options", MEASURED)
def test_plan_is_within_15_percent_of_measured_peaks(model, measured_gib, options):
    plan = mp.build_plan(model, PRESETS[model], PlanOptions(**options))
    _, peak = plan.peak()
    if "rollout_max_seqs" not in options:  # the update alone: no rollout engine existed
        peak = plan.phase_bytes(mp.UPDATE) - items(plan)["rollout weights (bf16 copy)"].gpu_bytes
    assert abs(peak / GIB - measured_gib) / measured_gib < 0.15


def test_render_lists_every_item_and_the_verdict():
    plan = mp.build_plan("qwen2.5-0.5b", QWEN05, PlanOptions(gpu_bytes=10 * GIB))
    text = render(plan, "trainer.gpu_memory_gib")
    assert all(item.name in text for item in plan.items)
    assert "10.0 GiB (trainer.gpu_memory_gib)" in text and "does NOT fit" in text
    unknown = render(mp.build_plan("qwen2.5-0.5b", QWEN05, PlanOptions()))
    assert "fit not checked" in unknown


def test_a_kept_kv_cache_and_split_placement():
    kept = mp.build_plan("q", QWEN05, PlanOptions(release_cache=False, rollout_max_seqs=64,
                                                  rollout_max_seq_len=1024))  # fmt: skip
    kv = next(i for i in kept.items if i.name.startswith("KV cache"))
    assert kv.phases == mp.ALWAYS  # never released: the update holds it too
    assert kept.phase_bytes(mp.UPDATE) - kv.gpu_bytes == mp.build_plan(
        "q", QWEN05, PlanOptions(rollout_max_seqs=64, rollout_max_seq_len=1024)
    ).phase_bytes(mp.UPDATE) + mp.fused_copy_bytes(QWEN05, "all")  # the fused copies stay too
    split = mp.build_plan("q", QWEN05, PlanOptions(split=True, rollout_max_seqs=64))
    on_rollout = {i.name for i in split.items if i.rollout_gpu}
    assert "rollout weights (bf16 copy)" in on_rollout and any("KV" in n for n in on_rollout)
    # the training GPUs hold the actor only: masters + AdamW while the rollout generates
    assert split.phase_bytes(mp.GENERATE) == 4 * P + 8 * P
    assert split.host_bytes() == 4 * P  # actor.full_weights(): fp32 masters on the controller


def test_an_fp8_rollout_adds_a_byte_per_projection_weight_while_it_generates():
    from hybridflow.models.presets import PRESETS

    a = PRESETS["qwen2.5-0.5b"]
    bf16 = mp.build_plan("qwen2.5-0.5b", a, mp.PlanOptions())
    fp8 = mp.build_plan("qwen2.5-0.5b", a, mp.PlanOptions(rollout_fp8=True))
    copies = [i for i in fp8.items if i.name == "rollout fp8 projection copies"]
    assert len(copies) == 1 and copies[0].gpu_bytes == a.num_parameters(include_embeddings=False)
    assert mp.GENERATE in copies[0].phases and mp.UPDATE not in copies[0].phases
    assert not any("fp8" in i.name for i in bf16.items)


def test_mixture_of_experts_counts_every_expert_stored_and_the_top_k_active():
    moe = PRESETS["qwen3-30b-a3b"]
    # per layer: router 128·2048; experts 128·3·2048·768 = 603,979,776 (8 of them active)
    # attention: q, o 2048·4096 each, k, v 2048·512 each = 18,874,368; norms and q/k-norm 4,352
    per_layer_experts = 128 * 2048 + 128 * 3 * 2048 * 768
    assert moe.mlp_parameters() == 48 * per_layer_experts
    assert moe.mlp_parameters(active=True) == 48 * (128 * 2048 + 8 * 3 * 2048 * 768)
    assert mp.linear_parameters(moe) == 48 * 18_874_368 + 48 * per_layer_experts
    text = render(mp.build_plan("qwen3-30b-a3b", moe, PlanOptions(master_bytes=2)))
    assert "30.53 B parameters, 3.35 B active (8 of 128 experts)" in text
    # a sparse layer keeps, per token, k·(4I + 4h) + 3E of its MLP instead of 4i:
    # 8·(3072 + 8192) + 384 = 90,496 against 4·6144 = 24,576
    dense = moe.replace(num_experts=0, model_type="qwen3")
    extra = mp.activation_bytes_per_token(moe, False) - mp.activation_bytes_per_token(dense, False)
    assert extra == 48 * 2 * (90_496 - 24_576)
    # the host step's largest tensor is a layer's gate_up experts [128, 1536, 2048]
    bucket = mp.host_step_bucket(moe, PlanOptions(optimizer_offload=True))
    assert bucket == 128 * 1536 * 2048


def test_lora_adapters_are_counted_beside_the_frozen_base():
    # Qwen3-30B-A3B, rank 64 on attention and every expert: per layer q, o 64·(2048 + 4096)
    # and k, v 64·(2048 + 512) = 1,114,112; per expert 64·((2048 + 2·768) + (768 + 2048)) =
    # 409,600, 128 of them; 48 layers -> 2,569,928,704 adapter parameters, fp32 (apply_lora)
    moe = PRESETS["qwen3-30b-a3b"]
    trainable = 48 * (1_114_112 + 128 * 409_600)
    assert mp.lora_parameters(moe, 64, mp.LORA_TARGET_SHAPES) == trainable
    base = moe.num_parameters()
    on_gpu = items(mp.build_plan("m", moe, PlanOptions(lora_rank=64, master_bytes=2)))
    assert on_gpu["actor weights (bf16 weights)"].gpu_bytes == 2 * base
    assert on_gpu["actor LoRA adapters (fp32)"].gpu_bytes == 4 * trainable  # 9.6 GiB
    assert on_gpu["actor gradients (fp32)"].gpu_bytes == 4 * trainable
    assert on_gpu["optimizer state (AdamW, fp32)"].gpu_bytes == 8 * trainable
    # AdamW on the host: the GPU keeps the bf16 base and bf16 copies of the adapters; the
    # host holds the adapters' fp32 masters and moments (learners/host_optimizer takes each
    # trained tensor's master in its own dtype: fp32 adapters beside a bf16 base)
    options = PlanOptions(lora_rank=64, master_bytes=2, optimizer_offload=True)
    host = items(mp.build_plan("m", moe, options))
    assert host["actor base weights (bf16, frozen)"].gpu_bytes == 2 * base
    assert host["actor LoRA adapters (bf16, masters on the host)"].gpu_bytes == 2 * trainable
    assert host["actor gradients (bf16)"].gpu_bytes == 2 * trainable
    assert host["actor master weights (fp32)"].host_bytes == 4 * trainable
    assert host["optimizer state (AdamW, fp32)"].host_bytes == 8 * trainable
    # two pinned bf16 buffers and an fp32 gradient buffer of one 64 M-parameter bucket (the
    # largest adapter tensor, a layer's gate_up_B [128, 1536, 64], is smaller)
    buffers = host["host step buffers (2 pinned bf16 + fp32 gradients)"]
    assert buffers.host_bytes == mp.OFFLOAD_BUCKET_ELEMENTS * (2 + 2 + 4)


def test_lora_count_of_a_mixture_of_experts_matches_the_adapters():
    pytest.importorskip("peft")
    from hybridflow.learners.lora import apply_lora
    from hybridflow.models import build_model

    config, targets = PRESETS["tiny-moe"], ("q_proj", "gate_proj", "down_proj")
    model = apply_lora(build_model(config), rank=4, alpha=8, target_modules=list(targets))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mp.lora_parameters(config, 4, targets) == trained


def test_the_deepseek_v3_latent_cache_holds_tens_of_times_the_rows_of_expanded_heads():
    """At 8k-token rows the plan sizes DeepSeek-V3's cache by its latent, 61 layers x (512 +
    64) values a token (70,272 bytes in bf16), as the engine allocates it (cache/latent.py);
    a GQA twin keeping its 128 heads' K (192) and V (128), 61 x 128 x 320 values (4,997,120
    bytes), holds under a tenth as many rows (1/71 of the bytes a row)."""
    from hybridflow.models.architecture import ModelArchitecture
    from hybridflow.trainer.plan.memory_rollout import kv_cache_item, kv_slot_bytes

    v3 = PRESETS["deepseek-v3"]
    twin = ModelArchitecture(model_type="qwen3_moe", vocab_size=v3.vocab_size,
                             hidden_size=v3.hidden_size, intermediate_size=v3.intermediate_size,
                             num_hidden_layers=61, num_attention_heads=128,
                             num_key_value_heads=128, head_dim=160)  # fmt: skip
    options = PlanOptions(rollout_max_seqs=4096, rollout_max_seq_len=8192, kv_block_size=64,
                          gpu_bytes=141 * GIB, gpu_memory_utilization=0.9)  # fmt: skip
    _, latent_rows, _ = kv_cache_item(v3, options, [])
    _, gqa_rows, _ = kv_cache_item(twin, options, [])
    budget = int(0.9 * 141 * GIB) - mp.rollout_reserve_bytes(v3, options)
    assert latent_rows == (budget // (64 * 61 * 576 * 2) - 1) // 128
    assert gqa_rows * 10 < latent_rows  # 193 rows against 2 (their workspaces differ too)
    assert kv_slot_bytes(twin, 8192) // kv_slot_bytes(v3, 8192) == 71


def _direct_q_deepseek():
    return PRESETS["tiny-deepseek-v3"].replace(q_lora_rank=None)


@pytest.mark.parametrize(
    "config", [PRESETS["tiny-gpt-oss"], PRESETS["tiny-deepseek-v3"], _direct_q_deepseek()]
)
@pytest.mark.parametrize("targets", [mp.LORA_TARGET_SHAPES, ("q_proj", "experts"),
                                     ("k_proj", "v_proj", "down_proj")])  # fmt: skip
def test_lora_count_of_gpt_oss_and_mla_matches_the_adapters(config, targets):
    """MLA adapts q_a/q_b (or q), kv_a and kv_b in place of q/k/v (k and v share them), the
    shared experts' projections beside each expert's factors; GPT-OSS's biased q/k/v/o and
    its experts stored [E, in, out]."""
    pytest.importorskip("peft")
    from hybridflow.learners.lora import apply_lora
    from hybridflow.models import build_model

    model = apply_lora(build_model(config), rank=4, alpha=8, target_modules=list(targets))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mp.lora_parameters(config, 4, targets) == trained


def test_lora_and_expert_parallel_shares_of_mla_and_biased_experts_by_hand():
    deepseek, gpt_oss = PRESETS["tiny-deepseek-v3"], PRESETS["tiny-gpt-oss"]
    # tiny-deepseek-v3 at rank 4 (h 64, 4 heads of nope 16 + rope 8, v 16, q rank 32, latent
    # 32; 1 dense layer of 128, 2 sparse of 8 experts of 32 and a shared one of 32), per
    # layer q_a 4·(64 + 32) + q_b 4·(32 + 96) + kv_a 4·(64 + 40) + kv_b 4·(32 + 128)
    # + o 4·(64 + 64) = 2,464; the dense MLP 3·4·(64 + 128) = 2,304; a shared expert
    # 3·4·(64 + 32) = 1,152; a layer's experts 8·4·((64 + 64) + (32 + 64)) = 7,168
    assert mp.lora_parameter_parts(deepseek, 4, mp.LORA_TARGET_SHAPES) == (
        3 * 2_464 + 2_304 + 2 * 1_152, 2 * 7_168)  # fmt: skip
    # tiny-gpt-oss (h 64, 4 heads and 2 KV heads of 16, 4 experts of 64, 2 layers): q and o
    # 4·(64 + 64), k and v 4·(64 + 32); a layer's experts 4·4·((64 + 128) + (64 + 64))
    assert mp.lora_parameter_parts(gpt_oss, 4, mp.LORA_TARGET_SHAPES) == (
        2 * 1_792, 2 * 5_120)  # fmt: skip
    # EP = 2 holds half of every expert: GPT-OSS's an expert's weights 3·64·64 and its biases
    # 2·64 + 64, 4 experts in 2 layers; DeepSeek's 3·64·32, 8 experts in 2 layers
    assert mp.rank_parameters(gpt_oss, 1, 2) == gpt_oss.num_parameters() - 2 * 4 * 12_480 // 2
    assert mp.rank_parameters(deepseek, 1, 2) == deepseek.num_parameters() - 2 * 8 * 6_144 // 2
    # a rank of 2 with EP = 2 and LoRA gathers the frozen base's share and its adapters: all
    # of peft's, half of the experts' factors (split with them)
    options = PlanOptions(lora_rank=4, train_gpus=2, ep=2, master_bytes=4, compute_bytes=4)
    gathered = items(mp.build_plan("m", deepseek, options))["actor gathered weights (fp32)"]
    assert gathered.gpu_bytes == 4 * (mp.rank_parameters(deepseek, 1, 2) + 12_000 + 7_168)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gpt-oss"])
def test_the_compute_copy_counts_mla_and_biased_projections_as_built(name):
    """What autocast casts: every linear projection of the mixers (MLA's five, GPT-OSS's
    biased q/k/v/o; not their norms or sinks) and the MLPs' weights."""
    from hybridflow.models import build_model

    config = PRESETS[name]
    model = build_model(config)
    projections = sum(
        module.weight.numel() + (module.bias.numel() if module.bias is not None else 0)
        for layer in model.model.layers
        for module in layer.self_attn.modules()
        if isinstance(module, torch.nn.Linear)
    )
    assert mp.linear_parameters(config) == projections + config.mlp_parameters()
