"""The rollout's items of the memory plan for a hybrid model (memory_rollout.py): K/V for its
attention quarter only, a recurrent state per slot, no fused decode copies (the engine decodes
it on its eager passes), and the rows of long responses it holds against a dense peer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.config import load_config
from hybridflow.engine.cache.arithmetic import state_slots, whole_sequence_slots
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan.memory_from_config import plan_for_config
from hybridflow.trainer.plan.memory_items import PlanOptions
from hybridflow.trainer.plan.memory_plan import build_plan
from hybridflow.trainer.plan.memory_rollout import (
    fused_copy_bytes,
    per_sequence_bytes,
    rollout_weight_parameters,
)

GIB = 2**30
LONG = ["data.max_prompt_length=512", "data.max_response_length=16384", "trainer.device=cuda",
        "trainer.n_gpus_per_node=1"]  # fmt: skip


def _kv_item(plan):
    return next(item for item in plan.items if item.name.startswith("KV cache"))


def _plan(model: str, *overrides: str):
    cfg = load_config(None, [f"model.path={model}", *LONG, *overrides])
    return plan_for_config(cfg, gpu_bytes=141 * GIB)


def test_a_hybrid_keeps_kv_in_its_attention_quarter_and_a_state_per_slot():
    a = PRESETS["qwen3.5-4b"]  # 8 attention layers of 4 KV heads x 256; 24 DeltaNet layers
    plan = _plan("qwen3.5-4b", "rollout.max_num_seqs=64")
    block, blocks_a_sequence = 64, -(-16896 // 64)
    kv_block = 8 * 2 * 4 * 256 * 2 * block  # K and V of the 8 attention layers, bf16
    state = 24 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)  # conv + fp32 SSM
    assert a.recurrent_state_bytes(2) == state
    item = _kv_item(plan)
    blocks = int(item.name.split("(")[1].split(" ")[0].replace(",", ""))
    assert item.gpu_bytes == (blocks + 1) * kv_block + 65 * state  # 64 slots + the scratch one
    assert plan.kv_slots == min(blocks // blocks_a_sequence, 64)
    # the dense layout would have charged all 32 layers K/V: 4x the bytes a block
    assert kv_block * 4 == 32 * 2 * 4 * 256 * 2 * block


def test_a_tensor_parallel_rollout_keeps_its_ranks_share_of_the_states():
    """rollout.tensor_parallel_size=2: a rank's blocks hold 2 of the 4 KV heads and its slots
    the state of 8 of the 16 Gated DeltaNet key heads with their value heads (conv channels
    and SSM state halved, engine/tensor_parallel.py), so a slot costs half the bytes."""
    plan = _plan("qwen3.5-4b", "rollout.max_num_seqs=64", "trainer.n_gpus_per_node=2",
                 "trainer.backend=local",
                 "rollout.tensor_parallel_size=2")  # fmt: skip
    kv_block = 8 * 2 * 2 * 256 * 2 * 64  # the rank's 2 KV heads
    state = 24 * ((2 * 8 * 128 + 16 * 128) * 3 * 2 + 16 * 128 * 128 * 4)  # 8 key heads' share
    assert state * 2 == PRESETS["qwen3.5-4b"].recurrent_state_bytes(2)
    item = _kv_item(plan)
    blocks = int(item.name.split("(")[1].split(" ")[0].replace(",", ""))
    assert item.gpu_bytes == (blocks + 1) * kv_block + 65 * state


def test_a_hybrid_decodes_without_fused_copies():
    a, dense = PRESETS["qwen3.5-4b"], PRESETS["qwen3-4b"]
    assert fused_copy_bytes(a, "all") == 0 == fused_copy_bytes(a, "qkv")
    assert fused_copy_bytes(dense, "qkv") > 0
    fused = next(i for i in _plan("qwen3.5-4b").items if "fused" in i.name)
    assert fused.gpu_bytes == 0


def test_balanced_slots_fill_the_budget_with_whole_sequences_and_their_states():
    # 10 sequences of 4 blocks of 25 bytes and 11 states of 5 (the scratch slot's) and the
    # scratch block: 10 slots; a byte less: 9
    assert whole_sequence_slots(10 * 100 + 11 * 5 + 25, 5, 25, 4) == 10
    assert whole_sequence_slots(10 * 100 + 11 * 5 + 25 - 1, 5, 25, 4) == 9
    assert whole_sequence_slots(3, 5, 25, 4) == 0
    assert state_slots(1024, 10 * 100 + 11 * 5 + 25, 5, 25, 4) == 10
    assert state_slots(8, 10 * 100 + 11 * 5 + 25, 5, 25, 4) == 8  # max_num_seqs bounds it
    assert state_slots(1024, 10 * 100 + 11 * 5 + 25, 5, 25, 4, cap=False) == 1024  # pinned
    assert state_slots(1024, None, 5, 25, 4) == 1024  # unbounded budget
    assert state_slots(1024, 3, 5, 25, 4) == 1  # the blocks' sizing names what one needs


def test_at_16k_responses_a_hybrid_holds_about_4x_the_rows_of_qwen3_4b():
    """Per 16,896-token row qwen3-4b keeps 36 layers of K/V (2.32 GiB); qwen3.5-4b 8 layers
    (0.52 GiB) and a 49 MiB recurrent state. The default 1,024 slots' states would take
    49 GiB first; the engine caps them at the slots that hold the most whole sequences
    (sizing.state_slots), and the plan with it: ~4x the rows under the defaults (the
    budgets differ by the models' other items)."""
    dense = _plan("qwen3-4b")
    hybrid = _plan("qwen3.5-4b")
    note = _kv_item(hybrid).note
    assert f"rollout.max_num_seqs=1,024 capped at {hybrid.kv_slots:,}" in note
    assert f"recurrent states of {hybrid.kv_slots + 1:,} slots" in note
    a, d = PRESETS["qwen3.5-4b"], PRESETS["qwen3-4b"]
    per_row = a.cache_bytes_per_sequence(16896) + a.recurrent_state_bytes(2)
    expected = d.cache_bytes_per_sequence(16896) / per_row  # 4.1
    budgets = _kv_item(hybrid).gpu_bytes / _kv_item(dense).gpu_bytes
    assert 3.5 < hybrid.kv_slots / dense.kv_slots
    assert abs(hybrid.kv_slots / dense.kv_slots - expected * budgets) < 0.1 * expected


def test_pinned_slots_keep_their_states_and_name_the_slots_that_hold_the_most():
    """rollout.engine.cap_state_slots=false: every one of max_num_seqs slots gets its state,
    and the plan names the max_num_seqs that holds the most whole sequences."""
    capped = _plan("qwen3.5-4b")
    pinned = _plan("qwen3.5-4b", "rollout.engine.cap_state_slots=false")
    note = _kv_item(pinned).note
    assert "recurrent states of 1,025 slots" in note
    assert f"rollout.max_num_seqs={capped.kv_slots:,})" in note
    assert pinned.kv_slots < capped.kv_slots / 2


def test_gpt_oss_rings_are_one_a_slot_beside_the_full_layers_blocks():
    """gpt-oss-20b: 12 full layers keep every position in the blocks, 12 sliding ones a ring
    of 128 positions a slot (engine/cache/window.py), sized as the engine sizes them."""
    options = PlanOptions(gpu_bytes=141 * GIB, rollout_max_seq_len=16896, split=True,
                          gpu_memory_utilization=0.9)  # fmt: skip
    plan = build_plan("gpt-oss-20b", PRESETS["gpt-oss-20b"], options)
    item = _kv_item(plan)
    per_layer = 2 * 8 * 64 * 2  # K and V of 8 KV heads of 64, bf16, a position
    block, ring = 12 * per_layer * 64, 12 * per_layer * 128
    blocks = int(item.name.split("(")[1].split(" ")[0].replace(",", ""))
    slots = int(item.note.split("window rings of ")[1].split(" ")[0].replace(",", "")) - 1
    assert item.gpu_bytes == (blocks + 1) * block + (slots + 1) * ring
    assert plan.kv_slots == blocks // 264 == min(slots, 1024)


def test_capped_slots_count_the_sampling_rows_they_give_back():
    # max_num_seqs 20 rows of 10 bytes of sampling already out of a budget of 990: capped
    # slots decode fewer rows, so a slot costs state 5 + row 10 + 4 blocks of 25 and the
    # budget has 20 rows back: 11 × 15 + 25 + 10 × 100 = 1,190 = 990 + 200 holds 10
    assert state_slots(20, 990, 5, 25, 4, row_bytes=10) == 10
    assert state_slots(20, 990, 5, 25, 4) == 9  # the rows' workspace kept out: one fewer


def test_an_fp8_kv_cache_halves_the_kv_line_and_about_doubles_the_sequences_it_holds():
    """rollout.engine.kv_cache_dtype=fp8 (engine/cache/fp8_kv.py): qwen2.5-1.5b keeps K/V of
    2 KV heads of 128 in 28 layers, 2·28·2·128·2 = 28,672 bytes a position in bf16 and
    2·28·2·(128 + 1·4) = 14,784 in e4m3 with an fp32 scale a head: 0.516 of it."""
    fp8 = "rollout.engine.kv_cache_dtype=fp8"
    few = ("rollout.max_num_seqs=16",)  # 16 sequences of 264 blocks fit either way
    blocks = 16 * 264 + 1  # and the scratch block
    assert _kv_item(_plan("qwen2.5-1.5b", *few)).gpu_bytes == blocks * 64 * 28_672
    fewer = _kv_item(_plan("qwen2.5-1.5b", *few, fp8))
    assert fewer.gpu_bytes == blocks * 64 * 14_784 and fewer.note.startswith("fp8 K/V")
    # 1,024 rows do not fit 141 GiB: the budget holds 1 / 0.516 = 1.94 times the sequences
    bf16_plan, fp8_plan = _plan("qwen2.5-1.5b"), _plan("qwen2.5-1.5b", fp8)
    assert 1.9 < fp8_plan.kv_slots / bf16_plan.kv_slots < 1.95 and fp8_plan.kv_slots < 1024
    assert _kv_item(fp8_plan).gpu_bytes == pytest.approx(_kv_item(bf16_plan).gpu_bytes, rel=1e-3)


def test_a_tensor_parallel_rollout_holds_its_shards_fused_and_fp8_copies():
    """The triton backend runs a tensor-parallel shard (engine/layers/split.py): each GPU holds
    the fused and fp8 copies of its heads and MLP columns, 1/tp of one GPU's."""
    gpus = ["trainer.backend=local", "trainer.n_gpus_per_node=2", "model.dtype=bfloat16",
            "rollout.dtype=fp8"]  # fmt: skip
    plans = [_plan("qwen2.5-7b", *gpus, f"rollout.tensor_parallel_size={tp}") for tp in (1, 2)]
    names = ("rollout fused q/k/v, gate/up copies", "rollout fp8 projection copies")
    sizes = [{i.name: i.gpu_bytes for i in plan.items if i.name in names} for plan in plans]
    assert sizes[0][names[0]] == fused_copy_bytes(PRESETS["qwen2.5-7b"], "all")
    for name in names:
        assert sizes[0][name] > 0 and sizes[1][name] == sizes[0][name] // 2


def test_released_rollout_weights_leave_the_update_and_the_forward_budget_grows():
    """rollout.release_weights: the copy is held in generation only; the update and the
    optimizer step lose exactly its bytes, generation keeps them (the sync brings them back
    at no more than generation's peak), and the log-prob passes get room beside the rest."""
    from hybridflow.trainer.plan.memory_choices import fitting_forward_tokens
    from hybridflow.trainer.plan.memory_items import GENERATE, STEP, UPDATE

    gpus = ["trainer.backend=local", "trainer.n_gpus_per_node=8", "rollout.tensor_parallel_size=2"]
    kept = _plan("qwen2.5-7b", *gpus)
    freed = _plan("qwen2.5-7b", *gpus, "rollout.release_weights=true")
    copy = next(i for i in kept.items if i.name.startswith("rollout weights"))
    released = next(i for i in freed.items if i.name.startswith("rollout weights"))
    # a tp rank's half, bf16 (the norms whole on both ranks)
    share = rollout_weight_parameters(PRESETS["qwen2.5-7b"], freed.options) * 2
    assert copy.gpu_bytes == released.gpu_bytes == share > 7 * GIB
    assert released.phases == (GENERATE,) and "rollout.release_weights" in released.note
    for phase in (UPDATE, STEP):
        assert kept.phase_bytes(phase) - freed.phase_bytes(phase) == copy.gpu_bytes
    assert kept.phase_bytes(GENERATE) == freed.phase_bytes(GENERATE)
    assert fitting_forward_tokens(freed) > fitting_forward_tokens(kept)


def test_an_engine_on_the_actors_tensors_has_no_copy_to_release():
    """One GPU, bf16: the engine reads the actor's parameters; releasing frees nothing."""
    one = ["model.dtype=bfloat16", "rollout.release_weights=true"]
    item = next(i for i in _plan("qwen2.5-7b", *one).items if i.name.startswith("rollout weights"))
    assert item.gpu_bytes == 0 and item.note == "reads the actor's in place"


def test_a_tensor_parallel_rank_keeps_its_kv_heads_share_of_the_rings():
    """gpt-oss-20b at rollout TP 2: a slot's rings hold the rank's 4 of the 8 KV heads
    (engine/cache/window.py), 12 sliding layers × 128 positions × K and V × 4 × 64 × 2 bytes."""
    a = PRESETS["gpt-oss-20b"]
    assert per_sequence_bytes(a, 4096, 2, tp=2) == 12 * 128 * 2 * 4 * 64 * 2
    assert per_sequence_bytes(a, 4096, 2, tp=1) == 2 * per_sequence_bytes(a, 4096, 2, tp=2)


@pytest.mark.parametrize("window", [131072, 10**6, 2**31 - 1])
def test_a_window_past_max_seq_len_is_priced_as_a_ring_of_max_seq_len(window):
    """gpt-oss-20b with a window no 4,096-token sequence fills: its rings hold 4,096
    positions (engine/cache/window.ring_length), a TP rank its KV heads' share, and the
    paged cache's plan prices that (not 2**31 - 1 positions a slot)."""
    a = replace(PRESETS["gpt-oss-20b"], attention_window=window)
    ring = 12 * 4096 * 2 * 8 * 64 * 2  # 12 sliding layers, K and V of 8 KV heads, bf16
    assert per_sequence_bytes(a, 4096, 2) == ring
    assert per_sequence_bytes(a, 4096, 2, tp=2) == ring // 2
    assert per_sequence_bytes(a, 128, 2) == per_sequence_bytes(PRESETS["gpt-oss-20b"], 4096, 2)
    options = PlanOptions(gpu_bytes=141 * GIB, rollout_max_seq_len=4096, split=True,
                          gpu_memory_utilization=0.9)  # fmt: skip
    plan = build_plan("wide", a, options)
    item, block = _kv_item(plan), 12 * 2 * 8 * 64 * 2 * 64  # the 12 full layers' block
    blocks = int(item.name.split("(")[1].split(" ")[0].replace(",", ""))
    slots = int(item.note.split("window rings of ")[1].split(" ")[0].replace(",", "")) - 1
    assert item.gpu_bytes == (blocks + 1) * block + (slots + 1) * ring
    assert plan.kv_slots == blocks // 64 == min(slots, 1024) > 0
    as_long = build_plan("as long", replace(a, attention_window=4096), options)
    assert _kv_item(as_long) == item
