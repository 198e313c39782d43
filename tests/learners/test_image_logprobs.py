"""The trainer's log-prob pass on a vision-language model: a Batch carrying each row's
images and mRoPE's position rows gives the log-probs of the model's own forward over the
whole sequence with its images, however the rows are grouped; an update step runs on them."""

import torch
from learner_helpers import actor_config

from hybridflow.data.image_batch import MROPE_POSITIONS, extend_positions, prompt_image_fields
from hybridflow.learners import ActorLearner
from hybridflow.models import load_model
from hybridflow.models.mrope import mrope_positions
from hybridflow.protocol import Batch

SPEC = load_model("tiny-vl").config.vision
IMAGE, START, END = SPEC.image_token_id, SPEC.vision_start_token_id, SPEC.vision_end_token_id
PROMPTS = [[5, START] + [IMAGE] * 4 + [END, 6], [7, 8, 9], [10, START] + [IMAGE] * 6 + [END]]
GRIDS = [torch.tensor([[1, 4, 4]]), None, torch.tensor([[1, 4, 6]])]
RESPONSES = [[11, 12, 13], [14, 15], [16]]


def _image_batch():
    generator = torch.Generator().manual_seed(0)
    width = SPEC.patch_elements
    pixels = [None if g is None else torch.randn(int(g.prod()), width, generator=generator)
              for g in GRIDS]  # fmt: skip
    length_p, length_r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    prompts = torch.zeros(len(PROMPTS), length_p, dtype=torch.long)
    responses = torch.zeros(len(PROMPTS), length_r, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), length_p + length_r, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        prompts[i, length_p - len(prompt) :] = torch.tensor(prompt)
        responses[i, : len(response)] = torch.tensor(response)
        mask[i, length_p - len(prompt) : length_p + len(response)] = 1
    rows = [mrope_positions(torch.tensor(p), g, IMAGE, SPEC.spatial_merge_size)
            for p, g in zip(PROMPTS, GRIDS)]  # fmt: skip
    tensors, arrays = prompt_image_fields(rows, pixels, GRIDS, length_p)
    response_mask = (mask[:, length_p:]).float()
    tensors[MROPE_POSITIONS] = extend_positions(tensors[MROPE_POSITIONS], response_mask)
    tensors.update(prompts=prompts, responses=responses, attention_mask=mask,
                   response_mask=response_mask, advantages=response_mask.clone(),
                   old_logprobs=-response_mask, ref_logprobs=-response_mask)  # fmt: skip
    return Batch(tensors, arrays), pixels


def _expected(model, pixels):
    """Each row alone, through the model's padded forward (which computes its rows)."""
    out = torch.zeros(len(PROMPTS), max(map(len, RESPONSES)))
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
            ids = torch.tensor([prompt + response])
            logits = model(ids, pixel_values=pixels[i], image_grid_thw=GRIDS[i])[0].float()
            logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
            out[i, : len(response)] = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def test_log_probs_with_images_equal_the_models_forward_and_an_update_runs():
    batch, pixels = _image_batch()
    actor = ActorLearner(load_model("tiny-vl"), actor_config(ppo_mini_batch_size=3),
                         total_steps=1, device="cpu")  # fmt: skip
    expected = _expected(actor.model, pixels)
    got = actor.compute_logprobs(batch)["old_logprobs"]
    assert (got - expected).abs().max() <= 1e-5
    one_at_a_time = ActorLearner(load_model("tiny-vl"), actor_config(
        ppo_mini_batch_size=3, micro_batch_size_per_gpu=1), total_steps=1, device="cpu")  # fmt: skip
    assert (one_at_a_time.compute_logprobs(batch.index([2, 0, 1]))["old_logprobs"]
            - expected[[2, 0, 1]]).abs().max() <= 1e-5  # fmt: skip
    metrics = actor.update(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def _tower_moves(**cfg) -> bool:
    batch, _ = _image_batch()
    actor = ActorLearner(load_model("tiny-vl"), actor_config(ppo_mini_batch_size=3, **cfg),
                         total_steps=1, device="cpu")  # fmt: skip
    before = [p.detach().clone() for p in actor.model.visual.parameters()]
    language_before = actor.model.model.embed_tokens.weight.detach().clone()
    actor.update(batch)
    assert not torch.equal(language_before, actor.model.model.embed_tokens.weight)
    return any(not torch.equal(a, b) for a, b in zip(before, actor.model.visual.parameters()))


def test_the_vision_tower_is_frozen_by_default_and_trains_on_request():
    assert not _tower_moves()
    assert _tower_moves(freeze_vision_tower=False)


def test_a_response_holding_the_image_pad_id_gets_no_image_features():
    """A sampled response token may be the image-pad id: the features go to the prompt's
    image tokens only, and the response's is embedded as the token it is."""
    global RESPONSES
    kept, RESPONSES = RESPONSES, [[11, IMAGE, 13], [14, 15], [IMAGE]]
    try:
        batch, pixels = _image_batch()
    finally:
        RESPONSES = kept
    actor = ActorLearner(load_model("tiny-vl"), actor_config(ppo_mini_batch_size=3),
                         total_steps=1, device="cpu")  # fmt: skip
    got = actor.compute_logprobs(batch)["old_logprobs"]
    prompt, response = PROMPTS[0], [11, IMAGE, 13]
    ids = torch.tensor(prompt + response)
    rows = batch.tensors[MROPE_POSITIONS][0][:, batch.tensors["attention_mask"][0].bool()]
    with torch.no_grad():
        hidden = actor.model.forward_packed(
            ids, rows, torch.tensor([0, len(ids)], dtype=torch.int32), len(ids),
            pixel_values=pixels[0], image_grid_thw=GRIDS[0],
            image_slots=torch.arange(len(ids)) < len(prompt),
        )  # fmt: skip
        logprobs = actor.model.lm_head(hidden).log_softmax(-1)[len(prompt) - 1 : -1]
    expected = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]
    assert (got[0] - expected).abs().max() <= 1e-5
