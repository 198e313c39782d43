"""The engine's working memory outside the KV cache (engine/cache/workspace.py): by hand for
Qwen3-30B-A3B, and the same number in the engine's reserve and the memory plan's."""

from __future__ import annotations

import pytest

from hybridflow.engine.cache.workspace import engine_workspace_bytes
from hybridflow.models.presets import PRESETS, preset_config

QWEN3_30B = PRESETS["qwen3-30b-a3b"]


def test_qwen3_30b_a3b_at_1024_rows_and_a_16384_token_chunk():
    # h 2048, I 6144 (unused: every layer is sparse), 32 q + 4 kv heads of 128, E 128, k 8,
    # I_e 768, V 151,936.
    # sampling: 1,024 rows × 151,936 × 22 bytes                        = 3,422,814,208
    # dense prefill: 16,384 × (8·2048 + 72·128 + 4·6144) × 2           = 1,644,167,168
    # sparse prefill: 16,384 × (8·2048 + 9,216) × 2 = 838,860,800; pairs 16,384·8 + 128
    #   experts × 128 padding rows = 147,456, × (3·768 + 2·2048) × 2 = 1,887,436,800; router
    #   16,384 × 128 × 8 = 16,777,216                                   = 2,743,074,816
    # the larger prefill with the sampling: 3,422,814,208 + 2,743,074,816 = 6,165,889,024
    # (5.7 GiB; the reserve before counted 3,961,782,272: 6 bytes a logit, no padding)
    assert engine_workspace_bytes(QWEN3_30B, 1024, 16384) == 6_165_889_024


def test_a_dense_model_and_tensor_parallel_ranks():
    # qwen2.5-0.5b: h 896, I 4864, 14 + 2 heads of 64, V 151,936; 256 rows, 4,096 tokens:
    # 256 × 151,936 × 22 + 4,096 × (7,168 + 2,048 + 19,456) × 2 = 855,703,552 + 234,881,024
    a = PRESETS["qwen2.5-0.5b"]
    assert engine_workspace_bytes(a, 256, 4096) == 855_703_552 + 234_881_024
    # over 2 ranks: 75,968 of the vocabulary, (1,024 + 9,728) of the head and MLP widths
    assert engine_workspace_bytes(a, 256, 4096, tp=2) == (256 * 75_968 * 22
                                                          + 4096 * (7_168 + 1_024 + 9_728) * 2)  # fmt: skip


def test_the_engine_reserves_what_the_plan_reserves(monkeypatch):
    """The engine's automatic cache size keeps engine_workspace_bytes free; the memory plan
    sizes the cache with the same number."""
    import torch

    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.engine.cache import sizing
    from hybridflow.models import build_model
    from hybridflow.trainer.plan.memory_plan import PlanOptions
    from hybridflow.trainer.plan.memory_rollout import rollout_reserve_bytes

    seen = {}

    def make_cache(cfg, batch, seq_len, block, budget, reserve, *rest, **options):
        seen["reserve"] = reserve
        raise RuntimeError("stop")

    monkeypatch.setattr(sizing, "make_cache", make_cache)
    model = build_model(preset_config("tiny-moe"), seed=0).eval().to(torch.float32)
    options = EngineOptions(decode_backend="torch", max_prefill_tokens=512)
    with pytest.raises(RuntimeError, match="stop"):
        Engine(model, max_batch_size=8, max_seq_len=64, options=options).generate(
            [[1, 2]], SamplingParams(max_new_tokens=2)
        )
    expected = engine_workspace_bytes(preset_config("tiny-moe"), 8, 512, 4)
    assert seen["reserve"] == expected
    plan = PlanOptions(rollout_max_seqs=8, max_prefill_tokens=512, rollout_bytes=4)
    assert rollout_reserve_bytes(PRESETS["tiny-moe"], plan) == expected


def test_mla_prefill_counts_its_expanded_heads():
    # deepseek-v3: 128 heads of q/k 128 + 64, v 128 (all padded to 192), latent 512 + 64.
    # attention a token: 128 × (4·192 + 128 + 128) + 576 = 131,648 (the GQA formula over
    # the config's 128 kv "heads" of head_dim 64 would say 32,768)
    # sampling 64 × 129,280 × 22 = 182,026,240; dense prefill (the larger here, MLP 18,432):
    # 1,024 × (8·7168 + 131,648 + 4·18,432) × 2 = 459,276,288; sparse: 1,024 × (57,344 +
    # 131,648) × 2 = 387,055,616, pairs (1,024·8 + 256·128) × (3·2048 + 2·7168) × 2 =
    # 1,677,721,600, router 1,024 × 256 × 8 = 2,097,152: 2,066,874,368
    a = PRESETS["deepseek-v3"]
    assert engine_workspace_bytes(a, 64, 1024) == 182_026_240 + 2_066_874_368


def test_a_vision_language_prefill_counts_the_encoder_and_the_kept_features():
    # qwen2.5-vl-7b: encoder e 1280, i 3420, 2x2 patches a token, features 3,584 wide; the
    # language model h 3584, I 18944, 28 + 4 heads of 128; 64 rows, a 16,384-token chunk:
    # encoder: 65,536 patches x (11·1280 + 3·3420 = 24,340) x 2        = 3,190,292,480
    # language model: 16,384 x (8·3584 + 64·128 + 4·18944 = 112,640) x 2 = 3,690,987,520
    # features kept: 16,384 x 3,584 x 2                                   =   117,440,512
    a = PRESETS["qwen2.5-vl-7b"]
    sampling = 64 * a.vocab_size * 22
    assert engine_workspace_bytes(a, 64, 16384) == sampling + 3_690_987_520 + 117_440_512
    # a wide encoder on a narrow language model: the encoder's blocks are the larger
    import dataclasses

    narrow = dataclasses.replace(a, intermediate_size=1024)
    text = 16384 * (8 * 3584 + 64 * 128 + 4 * 1024) * 2
    assert text < 3_190_292_480
    assert engine_workspace_bytes(narrow, 64, 16384) == sampling + 3_190_292_480 + 117_440_512


def test_capped_slots_give_the_rows_they_never_decode_back_to_the_cache(monkeypatch):
    """tiny-hybrid, paged: the automatic budget (a fraction of the device) has the sampling
    workspace of max_batch_size=64 rows taken out. Capped at the whole sequences it holds,
    the cache decodes fewer rows, so their workspace is the cache's again: one slot costs
    its state, its blocks and its row's sampling (sizing.state_slots). Without the
    give-back the slots would be those of the budget alone, fewer."""
    import torch

    from hybridflow.engine.cache import sizing
    from hybridflow.engine.cache.workspace import sampling_bytes_per_row

    config = preset_config("tiny-hybrid")
    row = sampling_bytes_per_row(config)
    probe, _ = sizing.make_cache(config, 4, 64, 16, 10**9, 0, torch.float32,
                                   torch.device("cpu"))  # fmt: skip
    state = probe.states.nbytes() // 5
    block = probe.keys[:, 0].numel() * probe.keys.element_size() * 2
    sequence = state + 4 * block + row  # 64 tokens: 4 blocks of 16
    budget = 10 * sequence + state + row + block - 64 * row  # 10 slots once rows come back
    monkeypatch.setattr(sizing, "cache_budget", lambda *args: budget)
    cache, pool = sizing.make_cache(config, 64, 64, 16, 0.9, 0, torch.float32,
                                      torch.device("cpu"), row_reserve_bytes=row)  # fmt: skip
    assert cache.num_slots == 10
    given_back = budget + 54 * row - 11 * state
    assert cache.num_blocks == given_back // block - 1
    without, _ = sizing.make_cache(config, 64, 64, 16, 0.9, 0, torch.float32,
                                     torch.device("cpu"))  # fmt: skip
    assert without.num_slots < 10
    # a budget in bytes is the cache's own: no row reserve was taken out, none comes back
    monkeypatch.undo()
    exact, _ = sizing.make_cache(config, 64, 64, 16, budget + 64 * row, 0, torch.float32,
                                   torch.device("cpu"), row_reserve_bytes=row)  # fmt: skip
    assert exact.num_slots == sizing.state_slots(64, budget + 64 * row, state, block, 4)


def test_the_plan_reserves_the_workspace_of_the_rows_capped_slots_decode():
    """qwen3.5-4b on an H200 at 16,896-token rows: the slots are capped far below
    max_num_seqs=1,024, and the plan's workspace is that of the rows decoded (the engine's
    make_cache gives the rest to the cache), not 1,024 rows' 5.2 GiB of sampling."""
    from hybridflow.trainer.plan.memory_items import GIB, PlanOptions
    from hybridflow.trainer.plan.memory_plan import build_plan
    from hybridflow.trainer.plan.memory_rollout import ROLLOUT_WORKSPACE, rollout_reserve_bytes

    a = PRESETS["qwen3.5-4b"]
    options = PlanOptions(gpu_bytes=141 * GIB, rollout_max_seq_len=16896, split=True,
                          gpu_memory_utilization=0.9, rollout_max_seqs=1024)  # fmt: skip
    plan = build_plan("qwen3.5-4b", a, options)
    workspace = next(i for i in plan.items if i.name == ROLLOUT_WORKSPACE)
    assert plan.kv_slots < 1024 // 4
    assert workspace.gpu_bytes == rollout_reserve_bytes(a, options, plan.kv_slots)
    assert rollout_reserve_bytes(a, options) - workspace.gpu_bytes > 4 * GIB  # of 5.2 GiB
