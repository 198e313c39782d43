"""SpreadRounds: what a rollout service's thread adds when the engine's experts are spread
over several replicas (engine/expert_spread.py, wide EP).

Each replica's service admits its own requests at its own moments, but every sparse layer's
all-to-all is a collective of the whole expert-parallel (EP) group. So the service threads
of the group move in iterations, each begun by a *beat*: one small MAX all-reduce over a
gloo group of the EP ranks that only these threads use, carrying

- whether this rank has work (a scheduler step to run), and
- how many group operations (pause, resume, a weight update, close: lockstep.py) every rank
  of its replica has posted, negated (the MAX of the negations is the group's MIN).

When no rank has work the iteration ends there: an idle group opens no round of the experts
(and, while every caller is quiet, waits ``poll_s`` between beats). When any rank has work,
those with work run one scheduler step, whose forward passes open the EP group's rounds
(expert_spread.join_round), and then every rank serves the others' rounds with no tokens
(expert_spread.serve_peers) until a round finds every rank done: every rank leaves the
iteration after the same rounds, whatever each one ran.

A group operation runs only once every rank of the EP group has posted it (the count of the
last beat), so each runs between the same two iterations on every rank: a weight update
reshards while no round is open anywhere (its collectives never meet a round's), and close
lets every rank's thread leave after the same beat. A rank whose callers are done (its agent
episodes over) keeps serving the others' rounds until every rank has closed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Beat:
    """What one beat found: any rank has work; group operations every rank has posted."""

    busy: bool
    posted: int


@dataclass(frozen=True)
class SpreadRounds:
    """model: the engine's wide-EP model (its spread's EP group carries the rounds); group:
    a gloo group of the same EP ranks, for the service thread's beats alone."""

    model: object
    device: torch.device
    group: object
    run_local_of: object = None
    """serve_peers' (the engine's peer_experts())."""

    def beat(self, working: bool, posted: int) -> Beat:
        flags = torch.tensor([int(working), -posted], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return Beat(bool(flags[0]), -int(flags[1]))

    def serve(self) -> int:
        """Join the EP group's rounds with no tokens until every rank is done -> rounds."""
        from hybridflow.engine.expert_spread import serve_peers

        return serve_peers(self.model, self.device, self.run_local_of)


def spread_rounds(engine, group) -> SpreadRounds:
    """The rounds of ``engine`` (a wide-EP engine: engine/expert_spread.py) with the beats
    over ``group`` (a gloo group of its EP ranks)."""
    if not engine.spread:
        raise ValueError("spread rounds need an engine whose experts are spread over replicas")
    return SpreadRounds(engine.model, engine.device, group, engine.peer_experts())
