"""validate()'s parallel-layout rules: each role's sizes tile its devices, the model's heads,
KV heads, MLP width, vocabulary and experts divide by them, and the layouts that have no code
path yet are refused (one function, :func:`not_yet_supported`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridflow.parallel.layout import layout_problems
from hybridflow.parallel.roles import (
    DIM_KEYS,
    RoleLayouts,
    RoleSize,
    kind_of,
    role_layouts,
    role_sizes,
    sizes_of,
)

if TYPE_CHECKING:
    from hybridflow.config.sections import Config
    from hybridflow.models.architecture import ModelArchitecture

Add = Callable[[str], None]

SUPPORTED_LAYOUTS: frozenset[tuple[str, str]] = frozenset(
    {(role, dim) for role in ("actor", "ref", "critic") for dim in ("sp", "tp")}
    # learners/sharding/sequence_shard.py, models/sharding/tensor_parallel.py
    | {("actor", "ep"), ("ref", "ep")}  # learners/sharding/expert_shard.py
    | {("rollout", "tp"), ("rollout", "ep")}  # engine/tensor_parallel.py, engine/reshard.py
)
"""(role, dimension) pairs whose code path exists, so a size > 1 runs. A pair joins this set
in the change that makes the role train or generate in that layout."""

WHAT = {"tp": "tensor parallelism", "sp": "sequence parallelism (Ulysses)",
        "ep": "expert parallelism"}  # fmt: skip
ROLE_NAMES = {"actor": "actor", "ref": "reference", "critic": "critic", "rollout": "rollout"}


def not_yet_supported(sizes: list[RoleSize], roles_in_use: set[str]) -> list[str]:
    """A size > 1 of a role whose code path for it does not exist yet: refused, never
    ignored (the run would otherwise train in a layout the config did not ask for)."""
    problems = []
    for size in sizes:
        if size.value <= 1 or size.role not in roles_in_use:
            continue
        if (size.role, size.dim) in SUPPORTED_LAYOUTS:
            continue
        own_key = f"{size.role}.{DIM_KEYS[size.dim]}"
        via = "" if size.key == own_key else f" ({own_key} is unset and follows {size.key})"
        problems.append(
            f"{size.key} = {size.value}{via}: {WHAT[size.dim]} is not yet supported for the "
            f"{ROLE_NAMES[size.role]}: set {own_key}=1 (docs/parallelism.md says what each "
            f"role runs in today)"
        )
    return problems


def not_built_with_tensor_parallel(
    cfg: Config, arch: ModelArchitecture | None, sizes: list[RoleSize], in_use: set[str]
) -> list[str]:
    """Training tensor parallelism (models/sharding/tensor_parallel.py) splits dense linear layers: a
    mixture of experts' sparse layers and LoRA adapters have no tensor-parallel path yet."""
    problems = []
    for size in sizes:
        if size.dim != "tp" or size.value <= 1 or size.role not in in_use - {"rollout"}:
            continue
        who = ROLE_NAMES[size.role]
        if arch is not None and arch.is_moe:
            problems.append(
                f"{who}: {size.key} = {size.value}: tensor parallelism of a mixture of experts' "
                f"sparse layers is not built yet: set {size.key}=1 (data, sequence and expert "
                "parallelism train it)"
            )
        if cfg.model.lora_rank > 0 and size.role != "critic":
            problems.append(
                f"{who}: {size.key} = {size.value} with model.lora_rank = {cfg.model.lora_rank}: "
                f"tensor parallelism of LoRA adapters is not built yet: set {size.key}=1 "
                "(sequence parallelism trains them) or model.lora_rank=0"
            )
    return problems


def not_built_with_expert_parallel(
    cfg: Config, sizes: list[RoleSize], in_use: set[str]
) -> list[str]:
    """The host step of one device (actor.optimizer_offload) has no expert-parallel path;
    FSDP2's param_offload keeps the experts' shards and their AdamW state on the host
    (learners/sharding/expert_shard.py)."""
    problems = []
    for size in sizes:
        if size.dim != "ep" or size.value <= 1 or size.role != "actor" or size.role not in in_use:
            continue
        if cfg.actor.optimizer_offload:
            problems.append(
                f"actor: actor.optimizer_offload = true with {size.key} = {size.value}: the host "
                "step runs on one device only: set actor.optimizer_offload=false and "
                "actor.param_offload=true (FSDP2 keeps each rank's expert shards and their "
                f"AdamW state on the host), or {size.key}=1"
            )
    return problems


def roles_in_use(use_reference: bool, use_critic: bool) -> set[str]:
    return (
        {"actor", "rollout"}
        | ({"ref"} if use_reference else set())
        | ({"critic"} if use_critic else set())
    )


def check_layouts(
    cfg: Config,
    worlds: dict[str, tuple[int, str]],
    in_use: set[str],
    add: Add,
    planning: bool = False,
) -> RoleLayouts | None:
    """Each role's sizes against its devices, the model's shape and the code paths that exist
    (``planning``: not the code paths, for ``config plan``). ``worlds``: "train"/"rollout" -> (devices, the keys that set them). Returns the layouts,
    or None when some role's sizes do not tile its devices."""
    sizes = role_sizes(cfg)
    tiled = True
    for role in ("actor", "ref", "critic", "rollout"):
        kind = kind_of(role)
        world, world_label = worlds[kind]
        labels = {"world": world_label, **{s.dim: s.key for s in sizes if s.role == role}}
        dims = sizes_of(cfg, role)
        problems = layout_problems(kind, world, dims["tp"], dims["sp"], dims["ep"], labels)
        if problems:
            tiled = False
            if role in in_use:
                for problem in problems:
                    add(f"{ROLE_NAMES[role]} layout: {problem}")
    architecture = _architecture(cfg)
    if architecture is not None:
        for role in sorted(in_use):
            _check_shape(role, architecture, sizes, add)
    if not planning:
        for problem in not_yet_supported(sizes, in_use):
            add(problem)
        for problem in not_built_with_tensor_parallel(cfg, architecture, sizes, in_use):
            add(problem)
        for problem in not_built_with_expert_parallel(cfg, sizes, in_use):
            add(problem)
        for problem in rollout_tensor_parallel_limits(cfg, architecture):
            add(problem)
        for problem in rollout_expert_limits(cfg, architecture):
            add(problem)
        for problem in rollout_fp8_kv_limits(cfg, architecture):
            add(problem)
        _check_runnable(cfg, add)
    if not tiled:
        return None
    return role_layouts(cfg, worlds["train"][0], worlds["rollout"][0])


def rollout_tensor_parallel_limits(cfg: Config, arch: ModelArchitecture | None) -> list[str]:
    """What a tensor-parallel rollout does not run yet (its ranks must run the same decode
    steps in lockstep). Partial rollouts and agent loops run: the group's ranks serve in
    rounds (engine/serving/lockstep.py), kept KV released on every rank at the same step; so
    do the fused decode layers (the split layer's all-reduces: engine/layers/split.py) and
    the fp8 rollout, on them and on the eager passes' layers (engine/fp8/linears.py). GQA,
    sink attention (full or windowed), MLA, gated attention and Gated DeltaNet layers split
    by heads (engine/tensor_parallel.py)."""
    size = cfg.rollout.tensor_parallel_size
    if size <= 1:
        return []
    key = f"rollout.tensor_parallel_size = {size}"
    problems = []
    unsplit = unsplit_mixers(arch)
    if unsplit:
        problems.append(f"{key}: the tensor-parallel rollout does not split this model's "
                        f"{', '.join(unsplit)} layers yet; set rollout.tensor_parallel_size=1")  # fmt: skip
    elif arch is not None and arch.is_moe:
        problems += _moe_rollout_limits(cfg, arch, key)
    return problems


def unsplit_mixers(arch: ModelArchitecture | None) -> list[str]:
    """The token mixers of ``arch`` the tensor-parallel rollout does not split
    (engine/tensor_parallel.SPLIT_MIXERS), by kind."""
    if arch is None:
        return []
    from hybridflow.engine.tensor_parallel import unsplit_mixers as kinds

    return kinds(arch)


def rollout_expert_limits(cfg: Config, arch: ModelArchitecture | None) -> list[str]:
    """rollout.expert_parallel_size above rollout.tensor_parallel_size spreads the experts
    over several replicas (engine/expert_spread.py: a multiple of tp dividing the rollout's
    GPUs, said by layout_problems). Its replicas move in rounds of the expert group (a
    rollout service joins them too: engine/serving/spread_rounds.py, so agent loops and
    partial rollouts run), on either decode backend (the fused layers dispatch by all-to-all:
    layers/moe.experts_triton; the fp8 rollout too), whose all-to-all sizes are read on the
    host: CUDA graphs are refused."""
    ep, tp = cfg.rollout.expert_parallel_size, cfg.rollout.tensor_parallel_size
    if ep is None or ep <= tp or (arch is not None and not arch.is_moe):
        return []  # a dense model's ep > 1: _check_shape says it has no experts
    if cfg.rollout.engine.cuda_graphs is not True:
        return []
    fix = f"rollout.expert_parallel_size={tp if tp > 1 else 1}"
    return [f"rollout.expert_parallel_size = {ep} (experts over several replicas) with "
            "rollout.engine.cuda_graphs = true: not yet supported (the all-to-all's sizes are "
            f"read on the host at every sparse layer); set {fix}, or leave "
            "rollout.engine.cuda_graphs unset"]  # fmt: skip


def rollout_fp8_kv_limits(cfg: Config, arch: ModelArchitecture | None) -> list[str]:
    """An FP8 KV cache (engine/cache/fp8_kv.py) holds full-attention K/V in the paged cache
    of a one-rank engine: the other cache kinds are refused here, before the model loads
    (the slot cache by EngineOptions.validate)."""
    engine = cfg.rollout.engine
    if engine.kv_cache_dtype != "fp8" or engine.kv_block_size is None or arch is None:
        return []
    from hybridflow.engine.cache.fp8_kv import fp8_kv_problem
    from hybridflow.engine.cache.kinds import engine_gaps

    specs = arch.layer_specs()
    if engine_gaps(specs):
        problem = "kv_cache_dtype='fp8': this model runs on the engine's slow path"
    elif cfg.rollout.tensor_parallel_size > 1:
        problem = "kv_cache_dtype='fp8' does not cover a tensor-parallel rollout yet"
    else:
        problem = fp8_kv_problem(specs, paged=True)
    return [] if problem is None else [f"rollout.engine.{problem}: set "
                                       "rollout.engine.kv_cache_dtype=model"]  # fmt: skip


def _moe_rollout_limits(cfg: Config, arch: ModelArchitecture, key: str) -> list[str]:
    """A tensor-parallel rollout of a mixture of experts: what it does not run yet (expert
    LoRA is merged as it reshards: workers/rollout_tp.training_sources)."""
    problems = []
    split = cfg.rollout.expert_parallel_size != 1
    if split and arch.num_experts % cfg.rollout.tensor_parallel_size:
        problems.append(
            f"{key} must divide the model's experts (num_experts = {arch.num_experts}) to "
            "split them over the replica's ranks: pick a divisor, or set "
            "rollout.expert_parallel_size=1 (every rank holds every expert)"
        )
    shared = arch.moe_intermediate_size * arch.n_shared_experts
    if shared % cfg.rollout.tensor_parallel_size:  # split like a dense MLP
        problems.append(
            f"{key} must divide the width of the model's shared experts (moe_intermediate_size "
            f"× n_shared_experts = {shared}): pick a divisor of {shared}"
        )
    gated = arch.shared_expert_intermediate_size  # Qwen3.5-MoE's, split like a dense MLP
    if gated % cfg.rollout.tensor_parallel_size:
        problems.append(
            f"{key} must divide the width of the model's shared expert "
            f"(shared_expert_intermediate_size = {gated}): pick a divisor of {gated}"
        )
    return problems


def _check_runnable(cfg: Config, add: Add) -> None:
    """A model shape the runtime cannot build is for the memory plan only."""
    from hybridflow.models.plan_shapes import PLAN_ONLY_SHAPES

    shape = PLAN_ONLY_SHAPES.get(cfg.model.path)
    if shape is not None:
        add(f"model.path = {cfg.model.path}: {shape.plan_only} (hybridflow config plan "
            f"model.path={cfg.model.path} ...)")  # fmt: skip


def _architecture(cfg: Config) -> ModelArchitecture | None:
    """The policy's shape without loading weights (an ``sft:`` run: its ``sft.preset``);
    None when unknown (an unreadable config.json is reported by the model checks)."""
    from hybridflow.models.architecture_file import directory_architecture
    from hybridflow.models.presets import PRESETS

    path = cfg.sft.preset if cfg.model.path.startswith("sft:") else cfg.model.path
    if path in PRESETS:
        return PRESETS[path]
    try:
        return directory_architecture(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _check_shape(role: str, arch: ModelArchitecture, sizes: list[RoleSize], add: Add) -> None:
    """The model's dimensions split by ``role``'s tp, sp and ep."""
    mine = {s.dim: s for s in sizes if s.role == role}
    tp, sp, ep = (mine[d].value if d in mine else 1 for d in ("tp", "sp", "ep"))
    if min(tp, sp, ep) < 1:
        return  # said by layout_problems
    who = ROLE_NAMES[role]
    heads, specs = arch.num_attention_heads, arch.layer_specs()
    # MLA's num_key_value_heads shapes nothing (every head reads the one latent)
    kv = arch.num_key_value_heads if any(spec.keeps_kv for spec in specs) else 0
    recurrent = arch.num_hidden_layers - arch.kv_layers  # layers whose state spans the sequence
    if recurrent and max(tp, sp) > 1:  # the rollout's tensor parallelism too (its engine's)
        _check_recurrent_heads(who, arch, mine, tp, sp, add)
    sinks = sum(spec.mixer == "sink_attention" for spec in specs)
    if sp > 1 and sinks:  # its attention runs outside the Ulysses-wrapped kernels
        add(f"{who}: {mine['sp'].key} = {sp}: this model's {sinks} attention-sink layers are not "
            f"split by sequence parallelism yet: set {mine['sp'].key}=1")  # fmt: skip
        return
    if tp > 1:
        tp_key = mine["tp"].key
        for what, count in (
            ("attention heads", heads),
            ("KV heads", kv),
            ("MLP width (intermediate_size)", arch.intermediate_size if _has_dense(arch) else 0),
            ("expert width (moe_intermediate_size)", arch.moe_intermediate_size
             if arch.is_moe and role != "rollout" else 0),  # the rollout keeps experts whole
            ("vocabulary (vocab_size)", arch.vocab_size),
        ):  # fmt: skip
            if count and count % tp:
                add(f"{who}: {tp_key} = {tp} must divide the model's {what} = {count}: pick a "
                    f"divisor of {count}")  # fmt: skip
    if sp > 1 and heads % tp == 0 and kv % tp == 0:
        sp_key = mine["sp"].key
        local_heads, local_kv = heads // tp, kv // tp
        if local_heads % sp:
            add(f"{who}: {sp_key} = {sp} must divide the attention heads per tensor-parallel "
                f"rank = {heads} / {tp} = {local_heads} (Ulysses gives each rank whole heads)")  # fmt: skip
        elif local_kv % sp and sp % local_kv:
            add(f"{who}: {sp_key} = {sp} and the KV heads per tensor-parallel rank = {kv} / {tp} "
                f"= {local_kv}: one must divide the other (Ulysses splits the KV heads, or "
                f"replicates each on {sp} / KV heads ranks when {sp_key} exceeds them)")  # fmt: skip
    if ep > 1:
        ep_key = mine["ep"].key
        if not arch.is_moe:
            add(f"{who}: {ep_key} = {ep} splits the experts of a mixture-of-experts model; this "
                f"model has none: set {ep_key}=1")  # fmt: skip
        elif arch.num_experts % ep:
            add(f"{who}: {ep_key} = {ep} must divide the model's experts (num_experts = "
                f"{arch.num_experts}): pick a divisor of {arch.num_experts}")  # fmt: skip


def _check_recurrent_heads(
    who: str, arch: ModelArchitecture, mine: dict[str, RoleSize], tp: int, sp: int, add: Add
) -> None:
    """Gated DeltaNet layers are split by key heads, each with the value heads it serves
    (models/sharding/tensor_parallel.py, deltanet_parallel.py): tp, then sp, must divide
    linear_num_key_heads (the value heads, a multiple of them, follow)."""
    heads = arch.linear_num_key_heads
    if tp > 1 and heads % tp:
        add(f"{who}: {mine['tp'].key} = {tp} must divide the model's Gated DeltaNet key heads "
            f"(linear_num_key_heads = {heads}): pick a divisor of {heads}")  # fmt: skip
    elif sp > 1 and (heads // tp) % sp:
        add(f"{who}: {mine['sp'].key} = {sp} must divide the Gated DeltaNet key heads per "
            f"tensor-parallel rank = linear_num_key_heads / {tp} = {heads // tp} (Ulysses gives "
            "each rank whole key heads with their value heads)")  # fmt: skip


def _has_dense(arch: ModelArchitecture) -> bool:
    return len(arch.sparse_layer_indices()) < arch.num_hidden_layers


def layout_notes(cfg: Config, in_use: set[str]) -> list[str]:
    """What a valid layout does that a reader may not expect (KV heads replicated by SP)."""
    arch = _architecture(cfg)
    if arch is None:
        return []
    notes = []
    for role in sorted(in_use - {"rollout"}):
        dims = sizes_of(cfg, role)
        tp, sp = dims["tp"], dims["sp"]
        if tp < 1 or arch.num_key_value_heads % tp:
            continue
        local_kv = arch.num_key_value_heads // tp
        if sp > local_kv and sp % local_kv == 0:
            notes.append(
                f"{ROLE_NAMES[role]}: sequence_parallel_size {sp} exceeds the {local_kv} KV "
                f"head(s) per tensor-parallel rank: each KV head is replicated on "
                f"{sp // local_kv} ranks around attention"
            )
    return notes
