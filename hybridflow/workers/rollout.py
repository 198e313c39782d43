"""The rollout role: the generation engine, fed from the actor's weights.

Three ways to get the weights, picked at construction:

- hybrid engine on one device (colocated actor, no sharding, no LoRA): the engine runs on the
  actor's own parameter tensors. An optimizer step is visible to the next ``generate`` with no
  copy, so :meth:`RolloutWorker.sync_from_actor` has nothing to do.
- colocated with a sharded (FSDP2) or LoRA actor: the engine owns a full copy; each sync
  all-gathers the actor's tensors one at a time (LoRA folded in) and loads them in buckets.
- split placement (no actor in this process): the controller moves the actor's full weights
  and calls :meth:`RolloutWorker.load_weights`.

Partial rollouts (trainer.partial_rollout, async mode): the engine runs as a RolloutService
(hybridflow/engine/serving/service.py) on its own thread. ``start_generate`` hands a batch to it and
returns; ``generated`` waits a short while for the result, so the weight sync of a training
step (a call on this same worker) gets in between and lands between two decode chunks of
the requests in flight: their later tokens record the new version (``token_versions``).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import torch

from hybridflow.config import Config
from hybridflow.config.rollout_section import kv_memory_share
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.data.image_batch import PIXEL_VALUES, prompt_images
from hybridflow.engine.scheduling.tail import TAIL_METRICS, tail_metrics
from hybridflow.engine.speculative import SPECULATIVE_METRICS
from hybridflow.engine.weights.release import check_rewritten
from hybridflow.protocol import Batch
from hybridflow.workers.model_loading import (
    load_causal_lm,
    resolve_dtype,
    set_cpu_threads,
)

# A batch without sample_index (a direct call, not the trainer's): different ranks draw
# different samples for their (different) prompts; keep their seeds apart.
RANK_SEED_STRIDE = 1_000_003


class RolloutWorker(Worker):
    """``generate(batch)``: n samples per prompt row, as right-padded response tensors."""

    def __init__(self, config: Config):
        from hybridflow.engine import Engine

        set_cpu_threads(config, self.device)
        self.config = config
        actor = self.context.colocated.get("actor")
        self.actor = actor
        dtype = resolve_dtype(config.model, self.device)
        t = config.trainer
        partial = t.mode == "async" and t.partial_rollout
        self.shares_actor_weights = (
            actor is not None
            and self.world_size == 1
            and (not actor.learner.lora or config.rollout.lora_in_place)  # adapters.py
            and not actor.learner.core.fsdp
            and next(actor.model.parameters()).dtype == dtype  # fp32 masters: bf16 copy
            # async mode generates while the actor updates: the engine needs its own copy
            and not (t.mode == "async" and (t.max_staleness > 0 or partial))
        )
        # rollout.tensor_parallel_size > 1: one engine over each tensor-parallel group;
        # rollout.expert_parallel_size above it: the experts spread over several replicas
        self.tensor = None
        r = config.rollout
        if r.tensor_parallel_size > 1 or (r.expert_parallel_size or 1) > r.tensor_parallel_size:
            self.tensor = self._tensor_parallel(config, dtype)
            model = self.tensor.model
        elif self.shares_actor_weights:
            model = actor.model
        else:
            model = load_causal_lm(config.model.path, dtype, self.device)
            model.requires_grad_(False)
        on_gpu = str(self.device).startswith("cuda")
        self.engine = Engine(
            model,
            max_batch_size=config.rollout.max_num_seqs,
            max_seq_len=config.data.max_prompt_length + config.data.max_response_length,
            memory_budget=kv_memory_share(config.rollout, t) if on_gpu else None,
            options=engine_options(config),
        )
        self.service = None  # partial rollouts: the engine serves from its own thread
        self.in_flight: dict[int, Future] = {}  # start_generate's ticket -> its result
        if partial and self.tensor is not None:  # the group's ranks serve in lockstep
            self.service = self.tensor.lockstep_services(self.engine)()
        elif partial:
            from hybridflow.engine.serving.service import RolloutService

            self.service = RolloutService(self.engine)
        # agent episodes on a tensor-parallel rollout or experts over several replicas: each
        # rank runs its own rows' episodes, served in lockstep for the batch (rollout_agents.py)
        self._agent_lockstep = None
        if config.rollout.agent.loop is not None and self.tensor is not None and not partial:
            self._agent_lockstep = self.tensor.lockstep_services(self.engine)
        self.agents = None
        if config.rollout.agent.loop is not None:
            from hybridflow.workers.rollout_agents import AgentEpisodes

            self.agents = AgentEpisodes(config, self.engine, self._agent_lockstep,
                                        self._release_cache)  # fmt: skip

    def _tensor_parallel(self, config: Config, dtype: torch.dtype):
        """This rank's part of a tensor-parallel engine with its first weights: resharded
        from the colocated actor, or sliced from the checkpoint (workers/rollout_tp.py)."""
        from hybridflow.workers.rollout_tp import TensorParallelRollout

        size = config.rollout.tensor_parallel_size
        # rollout.expert_parallel_size: unset or the tensor-parallel size splits the experts
        # over the group, 1 holds every expert on every rank (validate() refuses the rest)
        split, ep = config.rollout.expert_parallel_size != 1, config.rollout.expert_parallel_size
        # partial rollouts: the engine decodes on its service's thread while training runs
        own = config.trainer.mode == "async" and config.trainer.partial_rollout
        if self.actor is not None:
            return TensorParallelRollout.from_actor(self.actor, size, dtype, self.device,
                                                    config.model.path, split, ep, own)  # fmt: skip
        return TensorParallelRollout.from_checkpoint(config.model.path, size, dtype, self.device,
                                                     split, ep, own)  # fmt: skip

    @register(dispatch=Dispatch.RANK_ZERO)
    def engine_choices(self) -> dict:
        """The engine's timing choices (kernels, decode layers), for the run's checkpoint."""
        return self.engine.pinned_choices()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pin_engine_choices(self, recorded: dict) -> bool:
        """Run with the choices a checkpoint recorded (same model, GPU, options and versions;
        else nothing changes and False comes back), so a resumed run uses the same kernels."""
        return self.engine.pin_choices(recorded)

    @register(dispatch=Dispatch.DP_SPLIT)
    def generate(self, batch: Batch) -> Batch:
        """Sample ``meta["n"]`` responses for each row of ``prompts [b, P]`` (left-padded,
        ``attention_mask [b, P]``).

        Returns ``b * n`` rows, prompt-major (the samples of a prompt are adjacent):
        ``responses [b*n, R]`` (pad after the end), ``response_mask [b*n, R]`` (1 on generated
        tokens, the stop token included), ``rollout_logprobs [b*n, R]``, ``token_versions
        [b*n, R]`` (the policy version that sampled each token, -1 after the end); ``R`` is
        ``data.max_response_length`` on every rank so the pieces concatenate.
        """
        return self._generate(batch)

    @register(dispatch=Dispatch.DP_SPLIT)
    def start_generate(self, batch: Batch) -> None:
        """Partial rollouts: begin ``generate(batch)`` and return at once; collect it with
        ``generated(batch.meta["ticket"], …)``."""
        if self.service is None:
            raise RuntimeError("start_generate needs trainer.partial_rollout=true")
        result: Future = Future()
        self.in_flight[int(batch.meta["ticket"])] = result

        def run() -> None:  # waits on the service's thread, which decodes
            try:
                result.set_result(self._generate(batch))
            except BaseException as error:  # the controller's `generated` call re-raises it
                result.set_exception(error)

        # a daemon: a run that stops with a generation in flight does not wait for it to end
        threading.Thread(target=run, name="hybridflow-rollout-request", daemon=True).start()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def generated(self, ticket: int, wait_s: float) -> Batch | None:
        """The result of ``start_generate`` (this rank's rows) once, then None; None too
        while it is not done within ``wait_s`` seconds: short waits leave room for the
        trainer's calls (the controller keeps each rank's rows as they come)."""
        if ticket not in self.in_flight:
            return None
        try:
            out = self.in_flight[ticket].result(timeout=wait_s)
        except TimeoutError:
            return None
        del self.in_flight[ticket]
        return out

    def _generate(self, batch: Batch) -> Batch:
        if self.tensor is None:
            return self._generate_rows(batch, self.rank)
        if self.service is not None or self._agent_lockstep is not None:
            # a service (lockstep) runs every member's requests on each rank
            return self._generate_rows(batch, self.rank)
        # the group's chunks together on its engine; this rank keeps its own chunk's rows
        rows, chunk, chunk_rows = self.tensor.gather_rows(batch)
        out = self._generate_rows(rows, self.rank // self.tensor.size)
        per_chunk = len(out) // (len(rows) // chunk_rows)
        return out.index(slice(chunk * per_chunk, (chunk + 1) * per_chunk))

    def _generate_rows(self, batch: Batch, seed_rank: int) -> Batch:
        """batch's rows on this rank's engine. seed_rank: what keeps the seeds of a batch
        without sample_index apart from other engines' (their prompts differ)."""
        from hybridflow.engine import SamplingParams
        from hybridflow.engine.engine import padded_tensors

        cfg, meta = self.config.rollout, batch.meta
        width = self.config.data.max_response_length
        seed = meta.get("seed")
        sample_index = batch.tensors.get("sample_index")  # [b] each row's first sample
        if sample_index is not None:
            sample_index = sample_index.tolist()
        elif seed is not None:
            seed = int(seed) + RANK_SEED_STRIDE * seed_rank
        params = SamplingParams(
            n=int(meta.get("n", 1)),
            temperature=float(meta.get("temperature", cfg.temperature)),
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            min_p=cfg.min_p,
            max_new_tokens=width,
            stop_token_ids=tuple(meta.get("stop_token_ids", ())),
            seed=None if seed is None else int(seed),
            ignore_eos=cfg.ignore_eos,
        )
        pad_token_id = int(meta.get("pad_token_id", 0))
        if self.config.rollout.agent.loop is not None:
            if sample_index and params.seed is not None:  # episode k: seed + stride * k
                from hybridflow.agents.rollout import EPISODE_SEED_STRIDE

                first_seed = params.seed + EPISODE_SEED_STRIDE * sample_index[0]
                params = dataclasses.replace(params, seed=first_seed)
            return self.agents.generate(batch, params, pad_token_id)
        prompt_ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(batch.tensors["prompts"], batch.tensors["attention_mask"])
        ]
        if params.seed is None:
            sample_index = None  # a fresh draw: nothing to reproduce
        images = {}
        if PIXEL_VALUES in batch.arrays:  # each prompt's images, the engine's prefill runs them
            images["images"] = prompt_images(batch)
        speculation = self.engine.speculation  # its counters before, for this call's metrics
        before = dataclasses.replace(speculation.stats) if speculation is not None else None
        tail_before = dataclasses.replace(self.engine.tail)
        # through the service, if one runs
        results = self.engine.generate(prompt_ids, params, sample_index=sample_index, **images)
        self._release_cache()
        out = padded_tensors(results, pad_token_id)
        rows = out["responses"].shape[0]
        responses = torch.full((rows, width), pad_token_id, dtype=torch.long)  # [b*n, R]
        rollout_logprobs = torch.zeros(rows, width)  # [b*n, R]
        got = out["responses"].shape[1]
        responses[:, :got] = out["responses"]
        rollout_logprobs[:, :got] = out["rollout_logprobs"]
        positions = torch.arange(width)
        response_mask = (positions[None, :] < out["response_lengths"][:, None]).float()
        tensors = {
            "responses": responses,
            "response_mask": response_mask,
            "rollout_logprobs": rollout_logprobs,
            "token_versions": self._token_versions(results, width),
        }
        records = [c.routed_experts for c in results]
        # the experts each token went through (a dense model has none: nothing to replay)
        if self.config.actor.router_replay == "rollout" and any(r is not None for r in records):
            from hybridflow.engine.scheduling.routes import padded_routes

            prompt_lengths = [len(ids) for ids in prompt_ids for _ in range(params.n)]
            tensors["routed_experts"] = padded_routes(
                records,
                prompt_lengths,
                batch.tensors["prompts"].shape[1],
                width,
            )  # [b*n, P+R, L_sparse, k]
        return Batch(tensors, meta=self._engine_metrics(before, tail_before))

    def _release_cache(self) -> None:
        """rollout.release_cache after a generation on a GPU; a partial rollouts' service
        keeps its cache for the requests in flight."""
        if self.config.rollout.release_cache and str(self.device).startswith("cuda") and (
                self.service is None):  # fmt: skip
            self.engine.release()

    def _engine_metrics(self, speculation_before, tail_before) -> dict:
        """Batch.meta of the engine's metrics since the counters' copies taken before the
        call: this rank's (a concat keeps the first rank's meta)."""
        speculation, meta = self.engine.speculation, {}
        pair = None
        if speculation_before is not None:
            call = speculation.stats.since(speculation_before)
            meta[SPECULATIVE_METRICS] = call.metrics()
            pair = (call, speculation.stats)
        if self.engine.native:  # the slow path has no scheduler, so no tail
            tail = self.engine.tail
            meta[TAIL_METRICS] = tail_metrics(tail.since(tail_before), tail, pair)
        return meta

    def _token_versions(self, results: list, width: int) -> torch.Tensor:
        """[rows, width] int64: the version that sampled each token, -1 after the end. The
        engine's slow path (a model it cannot run natively) samples a request whole, with
        the weights of its current version, and records no spans."""
        versions = torch.full((len(results), width), -1, dtype=torch.long)  # [b*n, R]
        for row, completion in enumerate(results):
            if self.engine.native:
                row_versions = completion.token_versions()[:width]
            else:
                row_versions = [self.engine.policy_version] * min(len(completion.token_ids), width)
            versions[row, : len(row_versions)] = torch.tensor(row_versions, dtype=torch.long)
        return versions

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_from_actor(self, version: int | None = None) -> None:
        """Copy the colocated actor's current weights into the engine (shared: nothing to
        copy, but a new policy version, and a running service refreshes its fused copies).
        version: the policy version tokens sampled from now on record (default: the last + 1)."""
        if self.shares_actor_weights:
            if version is None:
                self.engine.weights_updated()
            else:
                self.engine.new_policy_version(version)
            return
        if self.actor is None:
            raise RuntimeError(
                "sync_from_actor needs an actor in the same worker (hybrid engine); with split "
                "placement the controller calls load_weights(actor.full_weights())"
            )
        if self.tensor is not None:  # the reshard: training shards into the engine's
            if self.service is None:
                restored = self.engine.restore_weights()  # rollout.release_weights
                self.tensor.sync(self.actor)  # every parameter of the shard
                check_rewritten(restored, set(dict(self.tensor.model.named_parameters())))
                self.engine.new_policy_version(version)
                return
            self.service.pause()  # between two decode steps of the requests in flight
            try:
                self.tensor.sync(self.actor)
            finally:
                self.service.resume(weights_changed=True, version=version)
            return
        self._load(self.actor.learner.hf_weights(dtype=self.engine.dtype), version)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Load full HF-named weights sent by the controller (split placement)."""
        if self.tensor is not None:
            self._load(self.tensor.local_slices(weights.items()), version)
            return
        self._load(weights.items(), version)

    def _load(self, named_tensors, version: int | None) -> None:
        if self.service is not None:  # between two decode chunks of the requests in flight
            self.service.update_weights(named_tensors, version=version)
            return
        restored = self.engine.restore_weights()  # rollout.release_weights
        written: set[str] = set()
        self.engine.load_weights(_recording(named_tensors, written))
        check_rewritten(restored, written)
        if version is not None:
            self.engine.new_policy_version(version)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def release(self) -> None:
        """Free the KV cache (training gets the memory back)."""
        self.engine.release()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def release_weights(self) -> int:
        """rollout.release_weights: free the engine's own weight copy for the step's passes
        and update (engine/weights/release.py); the next sync allocates and rewrites it. Nothing
        to free where the engine reads the actor's tensors. -> bytes freed on this rank."""
        if not self.config.rollout.release_weights or self.shares_actor_weights:
            return 0
        return self.engine.release_weights()

    def close(self) -> None:
        """The group's shutdown hook: a partial-rollout service stops its engine thread
        (aborting what is still in flight), so neither it nor the model outlives the run
        in a controller that goes on (the inprocess backend)."""
        if self.service is not None:
            self.service.close()
            self.service = None


def _recording(named_tensors, names: set[str]):
    """The (name, tensor) pairs as they come, each name added to ``names``."""
    for name, tensor in named_tensors:
        names.add(name)
        yield name, tensor


def engine_options(config: Config):
    """rollout.engine (with rollout.dtype's weight format, and the actor's FP8 recipe as the
    fp8 weights' scales when it trains in FP8), its pinned choices under trainer.cache_dir
    unless it names a directory."""
    import os

    options = config.rollout.engine
    if config.rollout.dtype == "fp8":
        options = dataclasses.replace(options, weight_format="fp8")
    if options.fp8_weight_scales == "auto" and config.actor.precision == "fp8":
        # the trainer's e4m3 weights and scales, not a second quantization (engine/fp8/weight_scales.py)
        options = dataclasses.replace(options, fp8_weight_scales=config.actor.fp8_recipe)
    if options.cache_dir is None:
        options = dataclasses.replace(
            options, cache_dir=os.path.expanduser(config.trainer.cache_dir)
        )
    return options
