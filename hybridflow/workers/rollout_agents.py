"""Agent episodes on the rollout's engine (rollout.agent.loop): n multi-turn episodes per
prompt row, through the built-in agent loop (hybridflow/agents/rollout.py) or the user's
program served on 127.0.0.1 (rollout.agent.loop=openai, hybridflow/agents/external.py).
workers/rollout.py's RolloutWorker holds one and hands it the rows of an agent rollout."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from hybridflow.config import Config
from hybridflow.data.image_batch import PIXEL_VALUES, prompt_images
from hybridflow.protocol import Batch
from hybridflow.workers.model_loading import default_tokenizer_path


class AgentEpisodes:
    """A rollout's agent episodes: its engine, its tokenizer (with a template that renders
    tool results), the agent loop (built at the first batch) and, on a tensor-parallel
    rollout or one of experts over several replicas, what makes the service whose ranks
    serve their episodes' turns in lockstep (``lockstep``: workers/rollout_tp.py's
    lockstep_services). ``release_cache``: what frees the engine's KV cache after a batch,
    as the worker does."""

    def __init__(self, config: Config, engine, lockstep: Callable | None,
                 release_cache: Callable[[], None]):  # fmt: skip
        from hybridflow.agents.templates import renders_tool_messages, with_tool_template
        from hybridflow.models.tokenizer import load_tokenizer

        self.config, self.engine, self.lockstep = config, engine, lockstep
        self.release_cache = release_cache
        self.loop = None  # built at the first agent rollout (rollout.agent.loop)
        tokenizer = load_tokenizer(default_tokenizer_path(config.model))
        # a tokenizer whose template cannot render tool results gets the built-in ChatML one
        self.tokenizer = tokenizer if renders_tool_messages(tokenizer) else (
            with_tool_template(tokenizer))  # fmt: skip

    def generate(self, batch: Batch, params, pad_token_id: int) -> Batch:
        """rollout.agent.loop: n multi-turn episodes per prompt row (its `raw_prompt`
        messages) through the agent loop; the rows' prompts become the agent's own
        (hybridflow/agents/rollout.py)."""
        from hybridflow.agents.client import EngineClient
        from hybridflow.agents.rollout import (
            build_loop,
            pack_trajectories,
            prompt_width,
            run_agent_batch,
        )

        cfg = self.config
        if "raw_prompt" not in batch.arrays:
            raise ValueError("rollout.agent.loop needs each row's chat messages (raw_prompt)")
        width = cfg.data.max_response_length
        turn_params = dataclasses.replace(params, n=1, seed=None)
        if cfg.rollout.agent.loop == "openai":
            per_turn = cfg.rollout.agent.max_tokens_per_turn or width
            turn_params = dataclasses.replace(turn_params, max_new_tokens=per_turn)
            trajectories = self._program_episodes(batch, params, turn_params, width)
            return self._packed(trajectories, pad_token_id, cfg.data.max_prompt_length)
        if self.loop is None:
            vision = getattr(self.engine.config, "vision", None)
            merge = None if vision is None else vision.spatial_merge_size
            self.loop = build_loop(cfg.rollout.agent, self.tokenizer, turn_params, width,
                                   image_merge_size=merge)  # fmt: skip
        self.loop.sampling = turn_params  # the temperature differs for validation
        # each row's images (the first prompt's; agents/images.py)
        images = None
        if PIXEL_VALUES in batch.arrays:  # rows computed from the agent's prompt, not these
            images = prompt_images(batch, dataset_positions=False)
        with self._service():
            trajectories = run_agent_batch(
                self.loop, EngineClient(self.engine), list(batch.arrays["raw_prompt"]),
                params.n, params.seed, cfg.rollout.agent.concurrency, images,
            )  # fmt: skip
        self.release_cache()
        packed = pack_trajectories(trajectories, width, pad_token_id,
                                   prompt_width(self.loop, cfg.data.max_prompt_length))  # fmt: skip
        return Batch(packed["tensors"], packed["arrays"])

    def _program_episodes(self, batch: Batch, params, turn_params, width: int) -> list:
        """rollout.agent.loop=openai: the user's agent program, once per episode, against
        the engine served on 127.0.0.1 (hybridflow/agents/external.py)."""
        from hybridflow.agents.external import ProgramServer, load_program, run_program_batch

        agent = self.config.rollout.agent
        program = load_program(agent.program)
        try:
            with self._service():
                server = ProgramServer(self.engine, self.tokenizer)
                try:
                    extra = batch.arrays.get("extra_info")
                    extra_infos = list(extra) if extra is not None else [None] * len(batch)
                    return run_program_batch(
                        program, server, self.tokenizer, list(batch.arrays["raw_prompt"]),
                        extra_infos, params.n, params.seed, turn_params, width,
                        agent.concurrency,
                    )  # fmt: skip
                finally:
                    server.close()  # its service stops: the engine is the trainer's again
        finally:
            self.release_cache()

    @contextlib.contextmanager
    def _service(self):
        """A tensor-parallel rollout's agent batch: the group's ranks serve their episodes'
        turns in lockstep (engine/serving/lockstep.py: each rank's turns and its releases of
        kept KV run on every rank between the same two steps); with experts over several
        replicas every rank also joins the expert group's rounds while any rank has turns to
        run (engine/serving/spread_rounds.py). Each rank's EngineClient talks to that service;
        closed (every rank's episodes done) before the batch ends. Elsewhere the client
        starts and stops a service of its own."""
        if self.lockstep is None:
            yield
            return
        service = self.lockstep()
        try:
            yield
        finally:
            service.close()

    def _packed(self, trajectories: list, pad_token_id: int, max_prompt_length: int) -> Batch:
        from hybridflow.agents.rollout import pack_trajectories

        width = self.config.data.max_response_length
        longest = max(len(t.prompt_ids) for t in trajectories)
        if longest > max_prompt_length:
            raise ValueError(
                f"an agent program's first prompt has {longest} tokens, more than "
                f"data.max_prompt_length={max_prompt_length}: raise data.max_prompt_length"
            )
        packed = pack_trajectories(trajectories, width, pad_token_id, max_prompt_length)
        return Batch(packed["tensors"], packed["arrays"])
