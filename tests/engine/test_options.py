"""EngineOptions (options.py): validation that names every bad field, the dict round trip,
and the options that key the pinned choices."""

from __future__ import annotations

import pytest

from hybridflow.engine.options import DECODE_LAYERS, EngineOptions


def test_defaults_are_valid_and_round_trip_through_a_dict():
    options = EngineOptions()
    assert options.validate() == []
    assert EngineOptions.from_dict(options.to_dict()) == options
    assert "lean:qkv" in DECODE_LAYERS and "auto" in DECODE_LAYERS


def test_every_bad_field_is_named_with_what_to_use():
    bad = EngineOptions(decode_backend="cuda", decode_layer="fast", fuse_projections="some",
                        decode_matmul="cutlass", steps_per_sync=0, sync_lag=2,
                        max_prefill_tokens=-1)  # fmt: skip
    problems = bad.validate()
    assert len(problems) == 7
    text = "\n".join(problems)
    for name in ("decode_backend='cuda'", "decode_layer='fast'", "fuse_projections='some'",
                 "decode_matmul='cutlass'", "steps_per_sync=0", "sync_lag=2",
                 "max_prefill_tokens=-1"):  # fmt: skip
        assert name in text
    assert "split" in text  # the allowed values are listed
    with pytest.raises(ValueError, match="invalid engine options"):
        bad.checked()


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="bogus"):
        EngineOptions.from_dict({"bogus": 1, "steps_per_sync": 4})


def test_timing_identity_leaves_out_what_does_not_change_timing():
    base = EngineOptions().timing_identity()
    assert (
        EngineOptions(cache_dir="/tmp/x", retune=True, steps_per_sync=16).timing_identity() == base
    )
    assert EngineOptions(decode_layer="split").timing_identity() != base
    assert EngineOptions(pdl=False).timing_identity() != base
    # the fp8 weights' scales key fp8 engines only (model-dtype ones keep their pinned choices)
    assert EngineOptions(fp8_weight_scales="rowwise").timing_identity() == base
    fp8 = EngineOptions(weight_format="fp8").timing_identity()
    assert EngineOptions(weight_format="fp8", fp8_weight_scales="rowwise").timing_identity() != fp8


def test_an_unknown_fp8_weight_scale_is_named_with_the_recipes():
    (problem,) = EngineOptions(fp8_weight_scales="blockwise").validate()
    assert "fp8_weight_scales='blockwise'" in problem and "rowwise, tensorwise" in problem


def test_graph_captured_mixed_and_verify_steps_accept_an_fp8_kv_cache():
    """The static steps pass an FP8 cache's scales to every kernel (scheduling/
    mixed_forward.py), so the pairs validate; the fp8 cache still needs the paged cache."""
    for graphs in (dict(graph_mixed_steps=True, max_prefill_tokens_per_step=2048),
                   dict(graph_verify_steps=True, speculative="ngram")):  # fmt: skip
        assert EngineOptions(**graphs, kv_cache_dtype="fp8", kv_block_size=64).validate() == []
        (problem,) = EngineOptions(**graphs, kv_cache_dtype="fp8", kv_block_size=None).validate()
        assert "kv_cache_dtype='fp8' covers the paged cache only" in problem
