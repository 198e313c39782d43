"""The reward-model role: a sequence classifier scoring each conversation (learners/
reward_model.py), beside the actor and reference on the training devices."""

from __future__ import annotations

from hybridflow.config import Config
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch
from hybridflow.workers.model_loading import default_tokenizer_path, resolve_dtype, set_cpu_threads


class RewardModelWorker(Worker):
    """``reward.model.path`` with its own tokenizer; the conversation is rendered again from
    text when that tokenizer or its chat template differs from the policy's."""

    def __init__(self, config: Config):
        from hybridflow.learners.reward_model import RewardModelScorer, same_tokenization
        from hybridflow.models import load_tokenizer
        from hybridflow.models.checkpoint_io.sequence_classifier import load_sequence_classifier

        options = config.reward.model
        set_cpu_threads(config, self.device)
        dtype = resolve_dtype(options, self.device)
        # loaded on the host when offloaded: the device gets it only while it scores
        where = "cpu" if options.param_offload else self.device
        model = load_sequence_classifier(options.path, dtype, where)
        reward_tokenizer = load_tokenizer(options.tokenizer_path or options.path)
        policy_tokenizer = load_tokenizer(default_tokenizer_path(config.model))
        rerender = not same_tokenization(policy_tokenizer, reward_tokenizer)
        self.scorer = RewardModelScorer(
            model,
            device=self.device,
            tokenizer=reward_tokenizer if rerender else None,
            micro_batch_size=options.micro_batch_size_per_gpu,
            max_tokens=options.max_tokens_per_gpu,
            offload=options.param_offload,
        )

    @register(dispatch=Dispatch.DP_SPLIT)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        return self.scorer.compute_rm_scores(batch)
