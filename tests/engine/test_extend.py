"""The triton extend pass (kept-KV turns): its varlen attention's spans on any device, and on
CUDA in bf16 the FlashAttention path against each token as a decode row over its slot."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.prefill import RopeTable, _sequence_spans, extend_forward_triton


def test_sequence_spans_list_every_cached_and_new_position_of_each_sequence():
    # sequence 0: slot 3, cached 2 + new 3 (positions 2..4); sequence 1: slot 1, cached 4 + new 1
    positions = torch.tensor([2, 3, 4, 4])
    slots = torch.tensor([3, 3, 3, 1])
    last = torch.tensor([2, 3])
    gather_slots, gather_positions, cu_new, cu_all, max_new, max_all = _sequence_spans(
        positions, slots, last
    )
    assert gather_slots.tolist() == [3] * 5 + [1] * 5
    assert gather_positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert cu_new.tolist() == [0, 3, 4] and cu_all.tolist() == [0, 5, 10]
    assert (max_new, max_all) == (3, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_extend_matches_decode_rows_in_bf16():
    import dataclasses

    from hybridflow.engine.kv_cache import allocate_cache
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    device = torch.device("cuda")
    config = dataclasses.replace(preset_config("qwen2.5-0.5b"), num_hidden_layers=2)
    model = build_model(config, seed=1, device=device).to(torch.bfloat16).eval()
    generator = torch.Generator(device).manual_seed(0)
    shape = model.config
    cache = allocate_cache(2, 4, 256, shape.num_key_value_heads, shape.head_dim, torch.bfloat16,
                           device)  # fmt: skip
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    rope = RopeTable(model.config, 256, torch.bfloat16, device)
    cached, new, slots = [37, 5, 120], [33, 1, 64], [2, 0, 3]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(device)
    token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(new)).to(device)
    last = (torch.tensor(new).cumsum(0) - 1).to(device)
    ids = torch.randint(0, model.config.vocab_size, (sum(new),), device=device,
                        generator=generator)  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    logits, kernels = {}, {}
    for kernel in ("decode", "flash"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            logits[kernel] = extend_forward_triton(
                model, cache, rope, ids, positions, token_slots, last, autotune=False,
                attention_kernel=kernel,
            ).float()  # fmt: skip
            torch.cuda.synchronize()
        kernels[kernel] = " ".join(event.key for event in prof.key_averages())
    assert "flash" in kernels["flash"] and "_decode_attention" not in kernels["flash"]
    assert "_decode_attention" in kernels["decode"]
    scale = logits["decode"].abs().max()
    assert (logits["flash"] - logits["decode"]).abs().max() <= 0.02 * scale
    assert (logits["flash"].argmax(-1) == logits["decode"].argmax(-1)).float().mean() >= 0.66
