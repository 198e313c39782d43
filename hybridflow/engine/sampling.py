"""Sampling parameters and the on-device, sync-free token sampler (torch reference path).

Exact sampling from softmax(z) over the allowed set, z = logits / T, done hierarchically so
that a GPU kernel needs one exp per vocabulary entry and no per-entry noise:

1. The vocabulary is cut into splits of SPLIT_SIZE tokens (the last one shorter; a vocabulary
   no longer than SPLIT_SIZE is one split). Per split j: m_j = max z, and
   f_j = sum over ALLOWED tokens of exp(z - m_j), so split j holds mass f_j * e^{m_j}.
2. One split J is drawn with Gumbel-max over log f_j + m_j (one hashed uniform per split):
   P(J = j) = f_j e^{m_j} / sum_k f_k e^{m_k}.
3. Inside split J, a token is drawn by inverse CDF: the first allowed token whose running
   sum of exp(z - m_J) reaches u2 * f_J (u2 another hashed uniform); should fp rounding leave
   the walk short of the target, the last token with positive mass in the split is taken.
   P(token i) = P(J) * e^{z_i - m_J} / f_J = e^{z_i} / sum_allowed e^{z}: exact.

The uniforms come from a counter-based hash of (request seed, decode step, split index) and
(request seed, decode step, a salt), so a request's samples depend on its seed only, never on
which batch or slot it ran in, and nothing needs a torch.Generator per request. The split
size is part of the scheme (same seed -> same token needs the same splits), so it is a
constant shared by this reference and the fused kernel (sampler_kernels.py), not a property
of the device.

Filters (applied in this order, each keeps the tokens whose z is >= a per-row threshold):
top-k (the k largest), top-p (smallest prefix of the top-k set, sorted by probability and
renormalised, whose mass reaches p), min-p (p_i >= min_p * p_max). The returned log-prob is
log_softmax(z) at the sampled token BEFORE filtering: the quantity PPO's ratio uses.
Greedy (temperature 0) returns argmax and log_softmax(logits) (temperature 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow.engine.options import MAX_TEMPERATURE, MIN_TEMPERATURE

MASK32 = 0xFFFFFFFF
_MIX_C1 = 0x7FEB352D
_MIX_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
LN2 = math.log(2)
_STEP_SALT = 0x27D4EB2F
_SEED_SALT = 0x165667B1
_SCAN_SALT = 0x85EBCA77  # differs from split * _GOLDEN (mod 2^32) for every split < 2^22

SPLIT_SIZE = 4096
"""Tokens per split of the hierarchical sampler (see the module docstring: a 152k vocabulary
is 38 splits per row; short enough that the in-split walk is cheap)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one instance applies to every prompt of a generate() call."""

    n: int = 1
    """Samples per prompt (prefilled once, fanned out)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""
    min_p: float = 0.0
    """Keep tokens with p >= min_p * p_max; 0 disables."""
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sample ends after it emits one of these (the stop token is returned)."""
    seed: int | None = None
    """Base seed; request (prompt i, sample j) uses a seed derived from (seed, i, j).
    None draws the base seed from torch's global generator."""
    ignore_eos: bool = False
    """Do not add the model's eos_token_id to the stop ids (stop_token_ids still apply)."""

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        # logits are divided by it in float32: outside these bounds they overflow or turn NaN
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            problems.append(
                f"temperature={self.temperature} must be 0 (greedy) or within "
                f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
            )
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p} must be in [0, 1)")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def mode_key(self) -> tuple:
        """What a compiled decode step depends on (CUDA graphs are cached per key)."""
        return (self.temperature, self.top_k, self.top_p, self.min_p)


# -------------------------------------------------------------------------------------------
# Counter-based noise (identical arithmetic in sampler_kernels.py, there on uint32)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x in [0, 2^32), without signed overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer finaliser ("lowbias32", C. Wellons) on int64 tensors holding uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_C2)
    return x ^ (x >> 16)


def split_seed(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 seeds [B] -> (low, high) 32-bit halves as int64 [B]."""
    return seeds & MASK32, (seeds >> 32) & MASK32


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (request seed, step) [B]."""
    key = mix32((steps & MASK32) ^ _STEP_SALT)
    key = mix32(key ^ seed_lo)
    return mix32(key ^ seed_hi ^ _SEED_SALT)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint32 hash values (int64) -> fp32 uniforms in (0, 1): the top 24 bits, centred."""
    return ((bits >> 8).float() + 0.5) * (1.0 / 16777216.0)


def uniform_noise(keys: torch.Tensor, count: int) -> torch.Tensor:
    """u [B, count] fp32 in (0, 1): one uniform per (row key, index) (index = split id)."""
    index_mix = _mul32(torch.arange(count, device=keys.device, dtype=torch.int64), _GOLDEN)
    return uniform_from_bits(mix32(keys[:, None] ^ index_mix[None, :]))  # [B, count]


def scan_uniform(keys: torch.Tensor) -> torch.Tensor:
    """u2 [B] fp32 in (0, 1): the in-split inverse-CDF draw of each row."""
    return uniform_from_bits(mix32(keys ^ _SCAN_SALT))


def request_seeds(base_seed: int, num_prompts: int, n: int) -> torch.Tensor:
    """Seeds [num_prompts * n] int64 for (prompt i, sample j), prompt-major."""
    idx = torch.arange(num_prompts * n, dtype=torch.int64)
    return _derive(torch.full_like(idx, base_seed), idx)


def indexed_request_seeds(base_seed: int, sample_index: list[int], n: int) -> torch.Tensor:
    """Seeds [len(sample_index) * n] int64 for some prompts of a larger call: prompt i's
    sample j is that call's request sample_index[i] + j, so it draws what request_seeds(
    base_seed, ...) gives it in the whole call (sample_index[i] = i * n: request_seeds
    itself). How a batch split over processes samples what one process would."""
    first = torch.tensor(sample_index, dtype=torch.int64)
    idx = (first[:, None] + torch.arange(n, dtype=torch.int64)[None, :]).flatten()
    return _derive(torch.full_like(idx, base_seed), idx)


def prompt_seeds(seeds: list[int], n: int) -> torch.Tensor:
    """Seeds [len(seeds) * n] when each prompt brings its own base seed: prompt i's samples
    draw what a call of that prompt alone with `seed=seeds[i]` draws, so requests batched
    together by a server sample as they would one by one."""
    base = torch.tensor(seeds, dtype=torch.int64).repeat_interleave(n)
    return _derive(base, torch.arange(n, dtype=torch.int64).repeat(len(seeds)))


def _derive(base: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    lo = mix32((base & MASK32) ^ mix32(idx & MASK32))
    hi = mix32((((base >> 32) & MASK32) + _GOLDEN) ^ lo)
    return lo | ((hi & 0x7FFFFFFF) << 32)


def prompt_seed_values(seeds: list[int], n: int) -> list[int]:
    """prompt_seeds as Python ints, the same arithmetic on ints: a server's single request
    gets its seed in microseconds instead of ~20 small tensor ops (~0.1 ms)."""
    out = []
    for base in seeds:
        for idx in range(n):
            lo = _mix32_int((base & MASK32) ^ _mix32_int(idx & MASK32))
            hi = _mix32_int((((base >> 32) & MASK32) + _GOLDEN) ^ lo)
            out.append(lo | ((hi & 0x7FFFFFFF) << 32))
    return out


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _MIX_C1) & MASK32
    x ^= x >> 15
    x = (x * _MIX_C2) & MASK32
    return x ^ (x >> 16)


def call_seeds(count: int, params: SamplingParams, seeds: list[int] | None = None,
               sample_index: list[int] | None = None) -> torch.Tensor | list[int]:  # fmt: skip
    """The per-request seeds [count * n] of a generate() call of `count` prompts: from a base
    seed per prompt (seeds), from params.seed as part of a larger call (sample_index), from
    params.seed, or from a random base seed when none is given. ValueError when the lengths
    do not match the prompts."""
    if sample_index is not None:
        if seeds is not None or params.seed is None or len(sample_index) != count:
            raise ValueError(f"sample_index: {len(sample_index)} given for {count} "
                             "prompts, with params.seed set and no seeds per prompt")  # fmt: skip
        return indexed_request_seeds(params.seed, list(sample_index), params.n)
    if seeds is not None:
        if len(seeds) != count:
            raise ValueError(f"seeds: {len(seeds)} given for {count} prompts")
        if count * params.n <= 64:  # a server's request: ints, no tensor ops
            return prompt_seed_values(list(seeds), params.n)
        return prompt_seeds(list(seeds), params.n)
    base_seed = params.seed
    if base_seed is None:
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
    if count == 1:  # request_seeds of one prompt: prompt_seeds with its base seed
        return prompt_seed_values([base_seed], params.n)
    return request_seeds(base_seed, count, params.n)


# -------------------------------------------------------------------------------------------
# Reference sampler (CPU and the eager decode path)


def filter_threshold(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Per-row threshold [B] on z [B, V] fp32: a token is allowed iff z >= threshold."""
    rows, vocab = z.shape
    threshold = torch.full((rows,), float("-inf"), device=z.device, dtype=z.dtype)
    k = top_k if 0 < top_k < vocab else vocab
    if top_p < 1.0:
        sorted_z = torch.topk(z, k, dim=-1).values if k < vocab else z.sort(-1, True).values
        probs = torch.softmax(sorted_z, dim=-1)  # renormalised over the top-k set
        mass_before = probs.cumsum(-1) - probs  # [B, k]
        kept = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        threshold = sorted_z.gather(-1, kept - 1).squeeze(-1)
    elif k < vocab:
        threshold = torch.topk(z, k, dim=-1).values[:, -1]
    if min_p > 0:
        min_p_threshold = z.max(-1).values + math.log(min_p)  # no host tensor: graph-safe
        threshold = torch.maximum(threshold, min_p_threshold)
    return threshold


def split_layout(vocab: int, split_size: int = SPLIT_SIZE) -> tuple[int, int]:
    """(number of splits, tokens per split) of a vocabulary; one split if it fits in one."""
    splits = -(-vocab // split_size)
    return splits, split_size if splits > 1 else vocab


def hierarchical_draw(
    z: torch.Tensor, threshold: torch.Tensor, keys: torch.Tensor, split_size: int = SPLIT_SIZE
) -> torch.Tensor:
    """Tokens [B] int64 drawn from softmax(z) restricted to z >= threshold [B] (module
    docstring, steps 1-3); z [B, V] fp32, keys [B] the per-row hash keys."""
    rows, vocab = z.shape
    splits, width = split_layout(vocab, split_size)
    zs = torch.nn.functional.pad(z, (0, splits * width - vocab), value=float("-inf"))
    zs = zs.view(rows, splits, width)  # [B, S, W]
    m = zs.amax(-1)  # [B, S]
    m_safe = torch.where(m == float("-inf"), 0.0, m)  # an all -inf split: exp(-inf) = 0, no nan
    allowed = zs >= threshold[:, None, None]
    mass = torch.where(allowed, torch.exp(zs - m_safe[..., None]), 0.0)  # [B, S, W]
    f = mass.sum(-1)  # [B, S]
    u = uniform_noise(keys, splits)
    gumbel = -LN2 * torch.log2(-torch.log2(u))  # minus the argmax-neutral ln(ln 2), like the kernel
    chosen = (torch.log(f) + m + gumbel).argmax(-1)  # [B]; f = 0 -> -inf, never chosen
    row = torch.arange(rows, device=z.device)
    mass = mass[row, chosen]  # [B, W]
    target = scan_uniform(keys) * f[row, chosen]  # [B]
    positive = mass > 0
    hit = (mass.cumsum(-1) >= target[:, None]) & positive
    first_hit = hit.to(torch.uint8).argmax(-1)  # first True
    last_positive = width - 1 - positive.flip(-1).to(torch.uint8).argmax(-1)
    position = torch.where(hit.any(-1), first_hit, last_positive)
    return chosen * width + position


def sample_reference(
    logits: torch.Tensor,
    params: SamplingParams,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    steps: torch.Tensor,
    split_size: int = SPLIT_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (tokens [B] int64, logprobs [B] fp32). No host sync.

    split_size is part of the sampling scheme: only tests pass another value."""
    if params.greedy:
        z = logits.float()
        tokens = z.argmax(-1)
    else:
        z = logits.float() / params.temperature
        threshold = filter_threshold(z, params.top_k, params.top_p, params.min_p)
        keys = row_keys(seed_lo, seed_hi, steps)
        tokens = hierarchical_draw(z, threshold, keys, split_size)
    logprobs = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return tokens, logprobs


def allowed_probs_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from [B, V] (for tests): filtered, renormalised."""
    z = logits.double() / params.temperature
    threshold = filter_threshold(z, params.top_k, params.top_p, params.min_p)
    z = torch.where(z >= threshold[:, None], z, float("-inf"))
    return torch.softmax(z, dim=-1)
