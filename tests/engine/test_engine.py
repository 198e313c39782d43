"""Engine on CPU (tiny preset, fp32): parity with transformers and with the trainer's
log-probs, batching invariance, stops, seeds, weights, memory release."""

from __future__ import annotations

import pytest
import torch
import transformers

from hybridflow.engine import Completion, Engine, EngineOptions, SamplingParams
from hybridflow.models import build_model
from hybridflow.models.heads.logprobs import logprobs_from_hidden
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41], [100, 3, 8, 19, 23, 60, 61, 62, 63, 7], [12]]


def _engine(model, **kwargs) -> Engine:
    kwargs.setdefault("max_batch_size", 8)
    kwargs.setdefault("max_seq_len", 64)
    return Engine(model, **kwargs)


def _tokens(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_greedy_matches_transformers_generate(model):
    # No eos on the HF side: with one, min_new_tokens would mask it (HF's MinNewTokens
    # processor) while our ignore_eos samples it like any token.
    hf_config = transformers.AutoConfig.for_model(**{**model.config.to_hf(), "eos_token_id": None})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ours = _tokens(_engine(model).generate(PROMPTS, params))
    for prompt, tokens in zip(PROMPTS, ours):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            pad_token_id=0,
        )  # fmt: skip
        assert tokens == out[0, len(prompt) :].tolist()


def test_logprobs_equal_trainer_logprobs(model):
    params = SamplingParams(n=2, temperature=0.8, top_k=20, max_new_tokens=10, seed=3)
    completions = _engine(model).generate(PROMPTS, params)
    for i, c in enumerate(completions):
        prompt = PROMPTS[i // 2]
        ids = torch.tensor(prompt + c.token_ids)
        hidden = model.forward_packed(
            ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), len(ids)
        )
        start = len(prompt) - 1  # hidden at t predicts token t + 1
        expected, _ = logprobs_from_hidden(
            hidden[start : start + len(c.token_ids)], model.lm_head.weight,
            torch.tensor(c.token_ids), temperature=0.8,
        )  # fmt: skip
        assert (torch.tensor(c.logprobs) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batching_invariance(model, temperature):
    """Together, one prompt at a time, and squeezed through 2 slots (continuous batching with
    slot reuse) give the same samples: noise depends on (seed, prompt, sample, step) only."""
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=9, seed=5)
    together = _tokens(_engine(model).generate(PROMPTS, params))
    squeezed = _tokens(_engine(model, max_batch_size=2).generate(PROMPTS, params))
    assert squeezed == together
    first_alone = _tokens(_engine(model).generate(PROMPTS[:1], params))
    assert first_alone == together[:2]
    if temperature == 0:
        for i, prompt in enumerate(PROMPTS):
            assert _tokens(_engine(model).generate([prompt], params)) == together[2 * i : 2 * i + 2]


def test_samples_of_one_prompt_differ_and_seed_reproduces(model):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    engine = _engine(model)
    first = _tokens(engine.generate(PROMPTS[:2], params))
    assert len({tuple(t) for t in first[:4]}) > 1
    assert _tokens(engine.generate(PROMPTS[:2], params)) == first
    other = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12)
    assert _tokens(engine.generate(PROMPTS[:2], other)) != first


def test_stop_ids_and_max_new_tokens(model):
    engine = _engine(model)
    free = engine.generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    )
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in free)
    stop = free[0].token_ids[3]  # greedy: this token appears at step 3 of prompt 0
    stopped = engine.generate(
        PROMPTS,
        SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[stop], ignore_eos=True),
    )
    for before, after in zip(free, stopped):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else 10
        assert after.token_ids == before.token_ids[:cut]
        assert after.finish_reason == ("stop" if stop in before.token_ids else "length")
    assert stopped[0].token_ids[-1] == stop and len(stopped[0].token_ids) <= 4
    # eos from the model config stops too unless ignore_eos
    model.config.eos_token_id, saved = stop, model.config.eos_token_id
    try:
        eos_stopped = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    finally:
        model.config.eos_token_id = saved
    assert _tokens(eos_stopped) == _tokens(stopped)


def test_max_seq_len_bounds_generation(model):
    engine = _engine(model, max_seq_len=16)
    out = engine.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 16 - len(PROMPTS[2]) and out[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([list(range(1, 17))], SamplingParams())


def test_generate_padded(model):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=2)
    engine = _engine(model)
    completions = engine.generate(PROMPTS, params)
    padded = engine.generate_padded(PROMPTS, params, pad_token_id=0)
    assert padded["responses"].shape == (8, 7)
    for row, c in enumerate(completions):
        length = padded["response_lengths"][row].item()
        assert padded["responses"][row, :length].tolist() == c.token_ids
        assert (padded["responses"][row, length:] == 0).all()
        assert padded["rollout_logprobs"][row, :length].tolist() == pytest.approx(c.logprobs)


def test_release_and_load_weights(model):
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    other = build_model(preset_config("tiny"), seed=7).eval()
    other_out = _tokens(_engine(other).generate(PROMPTS, params))
    clone = build_model(preset_config("tiny"), seed=1).eval()
    clone.load_state_dict(model.state_dict())
    engine = _engine(clone)
    before = _tokens(engine.generate(PROMPTS, params))
    engine.release()
    assert engine.cache is None
    engine.load_weights(other.state_dict().items(), bucket_bytes=1024)
    assert _tokens(engine.generate(PROMPTS, params)) == other_out != before
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights([("nope.weight", torch.zeros(1))])


def test_memory_budget_limits_slots(model):
    cfg = model.config
    per_slot = 2 * cfg.num_hidden_layers * 64 * cfg.num_key_value_heads * cfg.head_dim * 4
    slots = EngineOptions(kv_block_size=None)  # the slot cache: the budget sets the slots
    engine = _engine(model, memory_budget=per_slot * 4, options=slots)  # 3 slots + scratch
    assert engine.num_slots == 3
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_new_tokens=5))
    assert len(out) == 8
    with pytest.raises(ValueError, match="memory_budget"):
        assert _engine(model, memory_budget=per_slot, options=slots).num_slots


def test_memory_budget_limits_blocks(model):
    """The paged default: the budget sets the blocks, max_batch_size still the slots."""
    cfg = model.config
    per_block = 2 * cfg.num_hidden_layers * 64 * cfg.num_key_value_heads * cfg.head_dim * 4
    engine = _engine(model, memory_budget=per_block * 4)  # 3 blocks + scratch, 64 positions
    assert engine.num_slots == 8 and engine.cache.num_blocks == 3  # num_slots allocates
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_new_tokens=5))
    assert len(out) == 8
    with pytest.raises(ValueError, match="memory_budget"):
        assert _engine(model, memory_budget=per_block).num_slots


def test_transformers_fallback_runs_slow_path():
    """A model our decoder does not implement (GPT-2 here) generates through the slow path
    with the same sampler: greedy equals its own HF generate."""
    from hybridflow.models.checkpoint_io.hf_fallback import HFCausalLM

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    engine = Engine(HFCausalLM(hf), max_batch_size=4, max_seq_len=32)
    assert not engine.native
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    for prompt, completion in zip(prompts, out):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
            pad_token_id=0,
        )  # fmt: skip
        assert completion.token_ids == expected[0, len(prompt) :].tolist()
    params = SamplingParams(n=2, max_new_tokens=5, seed=1)  # GPT-2's eos is outside vocab 64
    sampled = _tokens(engine.generate(prompts, params))
    assert [len(t) for t in sampled] == [5, 5, 5, 5]
    assert _tokens(engine.generate(prompts, params)) == sampled


def test_refuses_max_seq_len_beyond_sliding_window():
    model = build_model(preset_config("tiny").replace(sliding_window=32)).eval()
    with pytest.raises(ValueError, match="sliding_window=32"):
        Engine(model, max_batch_size=2, max_seq_len=64)
    assert Engine(model, max_batch_size=2, max_seq_len=32).max_seq_len == 32


@pytest.mark.parametrize("steps_per_sync", [1, 3])
def test_lagged_host_reads_give_the_same_results(model, steps_per_sync):
    """The host reads each chunk's flags and tokens one chunk late (sync_lag=1): with early
    stops and slots reused through 2 slots, every request's tokens, log-probs and finish
    reason equal those of the wait-for-every-chunk loop (sync_lag=0). (Log-probs to fp32
    rounding: rows are admitted at other steps, so a step's batch size differs.)"""
    prompts = PROMPTS * 3
    sampling = dict(n=2, temperature=1.0, max_new_tokens=12, seed=4, ignore_eos=True)
    free = _engine(model).generate(prompts, SamplingParams(**sampling))
    # samples are the same up to a stop, so request 0 stops by its third token (the model's
    # random weights come from the global RNG: the stop is read off them, not fixed)
    stop = free[0].token_ids[2]
    params = SamplingParams(**sampling, stop_token_ids=[stop])
    results = {}
    for lag in (0, 1):
        options = EngineOptions(sync_lag=lag, steps_per_sync=steps_per_sync)
        engine = _engine(model, max_batch_size=2, options=options)
        assert engine.sync_lag == lag
        results[lag] = engine.generate(prompts, params)
    assert _tokens(results[1]) == _tokens(results[0])
    assert [c.finish_reason for c in results[1]] == [c.finish_reason for c in results[0]]
    for lagged, waited in zip(results[1], results[0]):
        assert torch.allclose(torch.tensor(lagged.logprobs), torch.tensor(waited.logprobs),
                              atol=1e-5, rtol=0)  # fmt: skip
    assert results[1][0].finish_reason == "stop" and len(results[1][0].token_ids) <= 3
    for c in results[1]:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == stop)
        assert len(c.token_ids) == len(c.logprobs) == 12 or c.finish_reason == "stop"


def test_one_new_token_per_request(model):
    """max_new_tokens=1: rows finish at admission and the loop ends (no decode chunk)."""
    out = _engine(model, max_batch_size=3).generate(
        PROMPTS, SamplingParams(n=2, temperature=0, max_new_tokens=1, ignore_eos=True)
    )
    assert [len(c.token_ids) for c in out] == [1] * 8
    assert all(c.finish_reason == "length" for c in out)


def test_cyclic_gc_is_paused_inside_generate_and_restored(model, monkeypatch):
    import gc

    from hybridflow.engine.scheduling import scheduler as loop_module

    seen = []
    run = loop_module.Scheduler.run

    def spy(self, sub):
        seen.append(gc.isenabled())
        return run(self, sub)

    monkeypatch.setattr(loop_module.Scheduler, "run", spy)
    assert gc.isenabled()
    _engine(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        _engine(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=0))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bad_prompts_are_named(model):
    engine = _engine(model, max_seq_len=16)
    vocab = model.config.vocab_size
    cases = [([[1, 2], []], "prompt 1 is empty"),
             ([[1], [2], list(range(1, 17))], "prompt 2 has 16 tokens; max_seq_len=16"),
             ([[1, 2], [3], [4, vocab, 5]], r"prompt 2 has token ids outside \[0, "),
             ([[1, 2], [-1], [4]], r"prompt 1 has token ids outside")]  # fmt: skip
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_stop_ids_outside_the_vocabulary_are_ignored(model):
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    engine = _engine(model)
    plain = engine.generate(PROMPTS, params)
    params_far = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True,
                                stop_token_ids=[vocab, vocab + 7])  # fmt: skip
    assert _tokens(engine.generate(PROMPTS, params_far)) == _tokens(plain)


def test_a_bad_prompt_past_the_first_prefill_is_named_and_the_engine_recovers(model):
    """Token ids are range-checked in pieces: the first admission's prompts before its prefill,
    the rest while it runs. A bad id in a later admission still raises before any result, and
    the rows the first admission left in the decode state do not leak into the next call."""
    engine = _engine(model, max_seq_len=32, options=EngineOptions(max_prefill_tokens=8))
    vocab = model.config.vocab_size
    good = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13], [14, 15]]
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=4)
    expected = [(c.token_ids, c.finish_reason) for c in engine.generate(good, params)]
    with pytest.raises(ValueError, match=r"prompt 3 has token ids outside"):
        engine.generate(good[:3] + [[14, vocab + 1]], params)
    assert engine.state.num_rows == 0  # the rows its first admission queued were dropped
    again = [(c.token_ids, c.finish_reason) for c in engine.generate(good, params)]
    assert again == expected


def test_young_objects_are_collected_only_while_the_gpu_is_busy():
    import gc

    from hybridflow.engine.host import collect_young, cyclic_gc_paused

    class Event:  # stands in for torch.cuda.Event
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    collected = []

    def watch(phase, info):
        if phase == "start":
            collected.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        with cyclic_gc_paused():
            kept = [[i, float(i)] for i in range(2 * gc.get_threshold()[0])]  # young objects
            assert not collect_young(Event(done=True))  # GPU idle: do not delay the next launch
            assert not collect_young(None)  # CPU: nothing to overlap with
            assert collected == []
            assert collect_young(Event(done=False))
            assert collected == [1] and gc.get_count()[0] < len(kept)
            assert not collect_young(Event(done=False))  # nothing young left
        gc.disable()  # a caller that turned collection off is never collected for
        try:
            with cyclic_gc_paused():
                kept += [[i] for i in range(2 * gc.get_threshold()[0])]
                assert not collect_young(Event(done=False))
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(watch)


def test_padded_tensors_pad_each_row_after_its_own_length():
    from hybridflow.engine.engine import Completion, padded_tensors

    results = [Completion([5, 6, 7], [-0.5, -1.25, -2.0], "length"), Completion([9], [-0.1], "stop"),
               Completion([], [], "stop"), Completion([1, 2], [-3.0, -4.0], "length")]  # fmt: skip
    out = padded_tensors(results, pad_token_id=99)
    assert out["responses"].tolist() == [[5, 6, 7], [9, 99, 99], [99, 99, 99], [1, 2, 99]]
    assert out["response_lengths"].tolist() == [3, 1, 0, 2]
    assert out["rollout_logprobs"].dtype == torch.float32
    expected = torch.tensor([[-0.5, -1.25, -2.0], [-0.1, 0, 0], [0, 0, 0], [-3.0, -4.0, 0]])
    assert torch.equal(out["rollout_logprobs"], expected)  # fp32, rounded as torch rounds
    empty = padded_tensors([], pad_token_id=0)
    assert empty["responses"].shape == (0, 0) and empty["response_lengths"].shape == (0,)


def test_per_prompt_seeds_sample_as_calls_of_each_prompt_alone(model):
    """seeds=[...]: prompt i of a batched call draws what generate([prompt i], seed=seeds[i])
    draws (a server batches independent requests without changing their samples)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    seeds = [11, 5, 11, 2**40 + 3]
    batched = _engine(model).generate(PROMPTS, params, seeds=seeds)
    for i, (prompt, seed) in enumerate(zip(PROMPTS, seeds)):
        alone = _engine(model).generate([prompt], SamplingParams(**{**vars(params), "seed": seed}))
        assert _tokens(batched[2 * i : 2 * i + 2]) == _tokens(alone)
        for a, b in zip(batched[2 * i : 2 * i + 2], alone):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert _tokens(batched[0:2]) != _tokens(batched[2:4]) or PROMPTS[0] != PROMPTS[2]
    with pytest.raises(ValueError, match="seeds: 2 given for 4 prompts"):
        _engine(model).generate(PROMPTS, params, seeds=[1, 2])


def test_a_call_split_in_pieces_samples_as_the_whole_call(model):
    """sample_index: the prompts of one call given to several engines (a batch split over
    processes, unevenly) draw what the whole call draws, prompt i's sample j as request
    i * n + j; without it each piece would draw as a call of its own."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=9)
    whole = _tokens(_engine(model).generate(PROMPTS, params))
    first = _engine(model).generate(PROMPTS[:1], params, sample_index=[0])
    rest = _engine(model).generate(PROMPTS[1:], params, sample_index=[2, 4, 6])
    assert _tokens(first + rest) == whole
    # rows of one prompt each (n=1, the prompt repeated): request i * n + j again
    repeated = [p for p in PROMPTS for _ in range(2)]
    one_each = SamplingParams(**{**vars(params), "n": 1})
    assert (
        _tokens(_engine(model).generate(repeated, one_each, sample_index=list(range(8)))) == whole
    )
    alone = _tokens(_engine(model).generate(PROMPTS[1:], params))
    assert alone != whole[2:]
    with pytest.raises(ValueError, match="sample_index: 1 given for 3 prompts"):
        _engine(model).generate(PROMPTS[1:], params, sample_index=[2])
