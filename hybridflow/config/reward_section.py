"""The ``reward`` section: the rule reward and its managers, a reward model
(``reward.model``), a generative judge (``reward.judge``) and how their parts are weighted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardModelOptions:
    path: str | None = None
    """A ``*ForSequenceClassification`` checkpoint (a local HF directory with a
    ``score.weight`` head) that scores each conversation; None: no reward model. Llama,
    Mistral and Qwen2/3 run in hybridflow's decoder, other architectures in transformers'."""
    tokenizer_path: str | None = None
    """Its tokenizer and chat template; None: the checkpoint directory's. When they differ
    from the policy's, the conversation is rendered again from text (prompt messages + the
    response as the assistant turn); else the policy's token ids are scored as they are."""
    micro_batch_size_per_gpu: int = 16
    """Conversations per reward-model forward on one device (without a token budget)."""
    max_tokens_per_gpu: int | None = None
    """Token budget of one packed reward-model forward; None: micro_batch_size_per_gpu
    conversations at a time."""
    param_offload: bool = False
    """Keep the reward model's weights in host memory between uses (colocated: the GPU
    memory goes to the other roles meanwhile; the memory plan counts it either way)."""
    dtype: str = "auto"
    """bfloat16 | float32 | float16 | auto (bf16 on a GPU, fp32 on the CPU)."""
    n_gpus_per_node: int = 0
    """Devices of the reward model's own pool, beside the trainer's, as verl's
    ``reward_model.n_gpus_per_node`` with ``enable_resource_pool``: the run then uses
    trainer.n_gpus_per_node + this devices of the node (the local backend puts the reward
    model on the last ones), and scoring runs beside the training passes. 0: the reward
    model shares the training devices (colocated)."""


@dataclass
class JudgeOptions:
    template: str | None = None
    """A text file holding the judge's prompt; None: no judge. ``{response}`` (required),
    ``{prompt}`` and ``{ground_truth}`` are replaced by the sample's; other braces stay as
    written."""
    engine: str = "rollout"
    """Who answers: "rollout" (the policy's own rollout service, greedy, at most
    data.max_response_length tokens; the judge prompt at most data.max_prompt_length) or
    "url" (a second model behind an OpenAI-compatible server: ``hybridflow serve``, vLLM)."""
    url: str | None = None
    """engine=url: the server's base URL, e.g. http://127.0.0.1:8000/v1."""
    model: str = "judge"
    """engine=url: the model name sent with each request."""
    max_tokens: int = 256
    """engine=url: tokens of one judge reply."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regular expression read from the reply; its last match is the score (group 1 if it
    has a group, else the whole match), which must parse as a number. A reply without a
    match is a failed sample (scores 0, counted)."""
    timeout_s: float = 60.0
    """engine=url: one judge request's limit; a request past it is a timeout (counted)."""
    concurrency: int = 16
    """engine=url: judge requests in flight at once."""


@dataclass
class RewardConfig:
    manager: str = "naive"
    """naive (one call per sample) | batch (custom_fn gets lists) | dapo (adds overlong shaping)."""
    custom_fn: str | None = None
    """``path/to/file.py:function`` scoring (data_source, solution_str, ground_truth, extra_info)."""
    num_workers: int = 0
    """Parallel scoring processes. reward.custom_fn always runs in worker processes (at
    least one), never in the trainer; 0: the built-in scorers run in the trainer."""
    timeout_s: float = 10.0
    """Per-sample scoring timeout; a timeout or exception scores 0 and is counted (the
    samples of a step are scored concurrently, so timeouts do not add up)."""
    max_failed_steps: int = 3
    """Consecutive training steps on which the reward fails on every sample before the run
    stops with the error (the messages are printed as they first happen)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping buffer B in tokens; 0: off."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty factor."""
    sandbox_isolation: str = "auto"
    """How the `code` reward isolates the programs it runs (the response against each
    test): "strict" (a jail per program; refuse to start where the machine cannot build
    one), "basic", "auto" (strict where possible); as rollout.agent.sandbox_isolation."""
    model: RewardModelOptions = field(default_factory=RewardModelOptions)
    """A reward model (sequence classifier) scoring each conversation: reward.model.path."""
    judge: JudgeOptions = field(default_factory=JudgeOptions)
    """A generative judge (an LLM reading a prompt template) scoring each response:
    reward.judge.template."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weight of each reward part in the score: ``rule`` (the data source's scorer, or
    reward.custom_fn), ``model`` (reward.model), ``judge`` (reward.judge); e.g.
    ``{rule: 1.0, model: 0.5}``. Empty: the rule reward alone, or, when a model or a judge
    is on, those (weight 1) without the rule reward, as verl's reward model replaces it. A
    part of weight 0 everywhere is not computed."""
    source_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per data source, weights that replace reward.weights for its samples, e.g.
    ``{gsm8k: {rule: 1.0}, chat: {model: 1.0}}``."""
