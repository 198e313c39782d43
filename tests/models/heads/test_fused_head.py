"""The fused log-prob head's torch path (the CPU, fp32/fp64) equals the naive full-logits
computation, values and gradients, for tiles that split tokens and vocabulary raggedly; and
the policy's passes give the same log-probs and gradients with the head fused or not, with a
tied or untied lm_head and with a LoRA adapter on the lm_head."""

import pytest
import torch
from model_helpers import randomized_model, small_config

from hybridflow.learners import lora
from hybridflow.learners.modules import PolicyModel, lm_head_operands
from hybridflow.learners.packing import pack_rows
from hybridflow.models.heads.fused_head import fused_logprobs, merge_partials
from hybridflow.models.heads.logprobs import logprobs_from_hidden, naive_logprobs


def _inputs(dtype, n=37, h=16, v=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0], targets[1] = 0, v - 1  # the first and last vocabulary entries
    upstream = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden, weight, targets, upstream


def _values_and_grads(head, hidden, weight, targets, upstream, entropy_grad=True):
    logprobs, entropy = head(hidden, weight, targets)
    loss = (logprobs.double() * upstream[0]).sum()
    if entropy_grad:
        loss = loss + (entropy.double() * upstream[1]).sum()
    hidden.grad = weight.grad = None
    loss.backward()
    entropy = None if entropy is None else entropy.detach()
    return logprobs.detach(), entropy, hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("token_chunk,vocab_chunk", [(5, 7), (4096, 8192), (16, 53)])
def test_values_and_gradients_equal_the_naive_head(dtype, tol, temperature, token_chunk,
                                                   vocab_chunk):  # fmt: skip
    inputs = _inputs(dtype)

    def fused(hidden, weight, targets):
        return fused_logprobs(hidden, weight, targets, temperature=temperature,
                              with_entropy=True, kernels=False, token_chunk=token_chunk,
                              vocab_chunk=vocab_chunk)  # fmt: skip

    ours = _values_and_grads(fused, *inputs)
    ref = _values_and_grads(lambda h, w, t: naive_logprobs(h, w, t, temperature), *inputs)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def test_logprob_only_gradient_and_no_entropy_equal_the_chunked_head():
    hidden, weight, targets, upstream = _inputs(torch.float32, seed=3)

    def head(fused):
        return lambda h, w, t: logprobs_from_hidden(h, w, t, chunk_size=8, fused=fused)

    fused = _values_and_grads(head(True), hidden, weight, targets, upstream, False)
    chunked = _values_and_grads(head(False), hidden, weight, targets, upstream, False)
    assert fused[1] is None
    for a, b in zip(fused[::2] + fused[3:], chunked[::2] + chunked[3:]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # log-probs, d hidden, d weight


def test_merge_of_hand_computed_partials():
    """Two vocabulary halves of logits [0, log 3 | log 2, 0], target 1 (in the first half):
    lse = log(1 + 3 + 2 + 1) = log 7, logprob = log 3 - log 7,
    entropy = log 7 - (3 log 3 + 2 log 2) / 7."""
    log2, log3 = torch.tensor(2.0).log(), torch.tensor(3.0).log()
    part_max = torch.stack([log3, log2])[:, None]
    part_sum = torch.tensor([[1 / 3 + 1], [1 + 1 / 2]])  # exp(l - max) summed per half
    part_weighted = torch.tensor([[log3], [log2]])  # exp(l - max) * l summed per half
    part_target = torch.stack([log3, torch.tensor(0.0)])[:, None]
    lse, logprob, entropy = merge_partials(part_max, part_sum, part_weighted, part_target)
    log7 = torch.tensor(7.0).log()
    torch.testing.assert_close(lse, log7[None])
    torch.testing.assert_close(logprob, (log3 - log7)[None])
    torch.testing.assert_close(entropy, (log7 - (3 * log3 + 2 * log2) / 7)[None])


def _packed(vocab: int):
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, vocab, (3, 4), generator=g)
    responses = torch.randint(3, vocab, (3, 5), generator=g)
    return pack_rows(prompts, responses, torch.ones(3, 9, dtype=torch.long))


def _policy_pass(policy: PolicyModel, packed, upstream):
    policy.zero_grad()
    logprobs, entropy = policy(packed, temperature=0.8, with_entropy=True)
    ((logprobs * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("tied", [False, True])
def test_policy_passes_equal_with_the_head_fused_or_not(tied):
    model = randomized_model(small_config("qwen2", tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    packed = _packed(model.config.vocab_size)
    upstream = torch.randn(2, packed.targets.shape[0], generator=torch.Generator().manual_seed(1))
    fused = _policy_pass(PolicyModel(model, fused_head=True), packed, upstream)
    chunked = _policy_pass(PolicyModel(model, fused_head=False), packed, upstream)
    torch.testing.assert_close(fused[0], chunked[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[1], chunked[1], atol=1e-5, rtol=1e-5)
    assert fused[2].keys() == chunked[2].keys()
    for name in fused[2]:
        torch.testing.assert_close(fused[2][name], chunked[2][name], atol=1e-5, rtol=1e-4)


def test_an_lm_head_adapter_enters_the_fused_head():
    """With "lm_head" in the LoRA targets, the fused head's log-probs and the adapter's
    gradients equal those of the adapted head's own forward (peft) and a log-softmax."""
    pytest.importorskip("peft")
    model = randomized_model(small_config("llama"))
    lora.apply_lora(model, rank=4, alpha=8, target_modules=["lm_head", "q_proj"])
    with torch.no_grad():  # B starts at zero: move it so the adapter changes the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    head = model.lm_head
    hidden = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, model.config.vocab_size, (11,))
    operands = lm_head_operands(head, hidden)
    assert operands[1].shape[1] == model.config.hidden_size + 4
    logprobs, _ = logprobs_from_hidden(*operands, targets, fused=True)
    logprobs.sum().backward()
    ours = [head.lora_A["default"].weight.grad.clone(), head.lora_B["default"].weight.grad.clone()]
    head.zero_grad()
    reference = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    reference.sum().backward()
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[0], head.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours[1], head.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4)
    assert ours[0].abs().sum() > 0
    with lora.adapters_disabled(model):  # the reference pass of a LoRA actor: the base head
        assert lm_head_operands(head, hidden)[1] is head.weight


def test_no_tokens_give_empty_outputs_and_a_zero_weight_gradient():
    """A micro-batch without output tokens (an empty response) still runs the head."""
    weight = torch.randn(53, 16, requires_grad=True)
    hidden = torch.zeros(0, 16, requires_grad=True)
    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True, fused=True
    )
    assert logprobs.shape == entropy.shape == (0,)
    (logprobs.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros_like(weight))
