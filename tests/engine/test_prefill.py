"""The engine's eager prefill (prefill.py) on CPU, fp32."""

from __future__ import annotations

import torch

from hybridflow.engine.cache.kv_cache import allocate_cache
from hybridflow.engine.prefill import RopeTable, prefill_forward
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def test_prefill_runs_the_last_layer_past_attention_on_last_tokens_only():
    """The last layer's MLP sees one row per prompt (not every packed token), and the logits
    still equal the model's own forward at each prompt's last position; the K/V of every
    token of the last layer is in the cache."""
    cfg = preset_config("tiny")
    model = build_model(cfg, seed=4).eval().requires_grad_(False)
    lengths = [5, 9, 3]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)) for n in lengths]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cache = allocate_cache(cfg.num_hidden_layers, 3, 16, cfg.num_key_value_heads, cfg.head_dim,
                           torch.float32, torch.device("cpu"))  # fmt: skip
    rows_seen = {}

    def record(index):
        def hook(module, args, out):  # returns None: the output stays as it is
            rows_seen[index] = args[0].shape[0]

        return hook

    hooks = [
        layer.mlp.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)
    ]
    try:
        logits = prefill_forward(model, cache, RopeTable(cfg, 16, torch.float32, ids.device),
                                 ids, positions, slots, cu.to(torch.int32), max(lengths),
                                 cu[1:] - 1)  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    last = cfg.num_hidden_layers - 1
    assert rows_seen[last] == len(lengths)
    assert all(rows_seen[i] == sum(lengths) for i in range(last))
    for i, prompt in enumerate(prompts):
        expected = model(prompt[None])[0, -1]
        torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)
        assert cache.keys[last, i, : lengths[i]].abs().sum() > 0
        assert cache.keys[last, i, lengths[i] :].abs().sum() == 0
