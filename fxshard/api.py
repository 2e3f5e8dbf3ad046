"""The public entry points: `shard` compiles a training step, `trace` only traces it, `check`
rejects a bad configuration before any process starts."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import warnings

import torch
import torch.nn as nn

from .batch import BatchSpec
from .config import Config
from .errors import FxShardError, user_stacklevel
from .optim import AdamW, Optimizer, SGD
from .mesh import Mesh
from .program import Program
from .runtime import CompiledStep
from .runtime.step import StepOrigin
from .init import MetaInit
from .runtime.state import initial_state
from .trace import trace as _trace


def trace(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None = None,
          config: Config | None = None, balance: bool = True) -> Program:
    """Trace `loss_fn(model, batch)`, its backward and the optimizer update into one Program.

    Runs on fake tensors: nothing is computed and a model on the `meta` device allocates nothing.
    `balance=False` leaves torchtitan's MoE load balancing out of the program (fxshard/balance.py), as
    the program of one microbatch that the pipeline pass cuts must (lower_schedule adds it per stage).
    """
    _check_arguments(model, loss_fn, optimizer, config)
    return _trace(model, loss_fn, example_batch, optimizer, config, balance=balance)


def shard(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None = None, mesh=None,
          config: Config | None = None) -> CompiledStep:
    """Compile one training step of `model` and return it as a callable `step(batch) -> metrics`.

    The returned step owns the training state from here on: it starts from the model's current
    parameters and buffers (the model itself is left unchanged) and `step.parameters()` reads them.
    Called under torch.inference_mode() it builds the same step, whose state trains outside it.
    """
    with torch.inference_mode(False):  # its state must not be inference tensors, which no update may write
        return _shard(model, loss_fn, example_batch, optimizer, mesh, config)


def _shard(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None, mesh, config: Config | None):
    config = config or Config()
    optimizer = optimizer or AdamW()
    _check_arguments(model, loss_fn, optimizer, config)
    mesh = _one_process(mesh)
    _refuse_no_mesh_in_a_job(mesh)
    groups, coords = _process_groups(mesh, config.collective_timeout_s, config.nccl_ctas, config.nccl_high_priority)
    job_group = _job_group(config.collective_timeout_s) if groups else None
    config = _with_dump_dir(config)
    tensors = [*model.parameters(), *model.buffers()]
    is_meta = any(t.is_meta for t in tensors)
    if is_meta and not all(t.is_meta for t in tensors):
        raise FxShardError("the model mixes meta-device and real tensors; build it wholly on one of them")
    batch_spec = BatchSpec.from_example(example_batch)
    if not is_meta:
        _check_devices(tensors, batch_spec.device)
    _warn_if_eval_mode(model)
    _warn_unused_pipeline_settings(mesh, config)
    stage = coords.get("pp", 0)
    programs = _compile_together(model, loss_fn, example_batch, optimizer, mesh, config, stage, groups)
    _warn_unused_moe_settings(programs, config)
    if programs[-1].stage is not None:
        groups.update(_stage_groups(programs[-1], mesh, config.collective_timeout_s, config.nccl_ctas,
                                    config.nccl_high_priority))
    config = _write_dumps(programs, mesh, config, coords)
    if groups:  # before anything is materialized: ranks that would issue different collectives stop here
        _check_ranks_agree(programs, model, batch_spec, optimizer, mesh, config, groups, stage, job_group)
    # A meta-device model is initialized here, per module and seeded by module path (fxshard.init):
    # each rank materializes only its own shards.
    source = MetaInit(model, config.seed, batch_spec.device) if is_meta else model
    state = initial_state(programs[-1], source, optimizer, coords, batch_spec.device)

    structure = _structure_of(model)

    def compile_evaluation() -> Program:  # step.evaluate's program, compiled on its first call
        from .runtime.evaluate import EvalMode, forward_only

        with EvalMode(structure):  # every rank calls evaluate(): its trace is shared as shard's is
            evaluation = forward_only(_compile(structure, loss_fn, example_batch, optimizer, mesh, config, (stage,),
                                               share=_shares(mesh, config.share_trace))[-1])
        if config.dump_dir:
            from .dump import still_dumped

            if still_dumped(programs[-1], config.dump_dir, len(programs) - 1):
                evaluation.dump(config.dump_dir, len(programs) + 1)
            else:  # a later shard() dumped into the folder (and cleared this run's files)
                warnings.warn(f"fxshard: step.evaluate's program is not dumped to {config.dump_dir}: another run "
                              f"has dumped there since this step was built, and the folder shows that run alone",
                              stacklevel=3)
        return evaluation

    origin = StepOrigin(coords, _global_rank(), mesh, _expert_layouts(model), type(model).__name__,
                        getattr(model, "cfg", None), _hf_config(model), _transient_buffers(model),
                        _aliases(model), tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()))
    step = CompiledStep(programs, state, batch_spec, optimizer, batch_spec.device, groups, config,
                        share_compile=_shares(mesh, config.share_compile), origin=origin,
                        evaluation=compile_evaluation, model=model, job_group=job_group,
                        first_batch_check=_pipeline_batch_check(mesh, groups, programs[-1], batch_spec.device))
    if config.dump_dir or config.verbose:
        _report_lowerings(step, config, len(programs))
    return step


def _with_dump_dir(config: Config) -> Config:
    """`config` with FXSHARD_DUMP as its dump_dir where it names none, the directory made now (not
    after compiling) or refused."""
    from_environment = config.dump_dir is None and bool(os.environ.get("FXSHARD_DUMP"))
    if from_environment:
        try:
            config = dataclasses.replace(config, dump_dir=os.environ["FXSHARD_DUMP"])
        except FxShardError as error:  # a file, say: name where the path came from
            raise FxShardError(f"the environment's FXSHARD_DUMP: {error}") from None
    if config.dump_dir is not None:
        named = (f"FXSHARD_DUMP={str(config.dump_dir)!r}" if from_environment
                 else f"Config(dump_dir={str(config.dump_dir)!r})")
        try:
            os.makedirs(config.dump_dir, exist_ok=True)
        except OSError as error:
            raise FxShardError(f"{named} cannot be made ({error.strerror}); choose a directory this process can "
                               f"write") from error
        if not os.access(config.dump_dir, os.W_OK | os.X_OK):  # an existing directory: makedirs says nothing
            raise FxShardError(f"{named} exists but this process cannot write in it; choose a directory it can write")
    return config


def _compile_together(model, loss_fn, example_batch, optimizer, mesh, config: Config, stage: int,
                      groups: dict) -> list[Program]:
    """This rank's programs (the trace and each pass's result). A rank whose trace failed (its own
    data, its own memory) does not leave the others waiting: on a mesh every rank raises."""
    try:
        programs, failure = _compile(model, loss_fn, example_batch, optimizer, mesh, config, (stage,),
                                     share=_shares(mesh, config.share_trace)), None
    except Exception as error:  # noqa: BLE001  raised below, once every rank knows
        failure = error
    if groups:
        from .runtime.agreement import fail_together

        fail_together(failure, "compile the step")
    if failure is not None:
        raise failure
    return programs


def _write_dumps(programs: list[Program], mesh, config: Config, coords: dict) -> Config:
    """Writes the programs' dumps where this rank is their one writer (a pipeline: a folder per stage,
    its first data-parallel rank's; otherwise the mesh's first rank), clearing what an earlier run left
    there. Returns `config` with the dump_dir this rank writes to (None: none)."""
    stage = coords.get("pp", 0)
    if programs[-1].stage is not None:
        dump_dir = os.path.join(config.dump_dir, f"stage{stage}") if config.dump_dir and coords["dp"] == 0 else None
        config = dataclasses.replace(config, dump_dir=dump_dir)
    elif config.dump_dir and any(coords.values()):
        config = dataclasses.replace(config, dump_dir=None)
    if config.dump_dir:
        from .dump import clear_stale_dumps, dump_programs

        clear_stale_dumps(config.dump_dir, stage=stage if programs[-1].stage is not None else None,
                          stages=mesh.pp if mesh is not None else 1)
        dump_programs(programs, config.dump_dir)
        if programs[-1].stage is not None:
            _dump_schedule(programs, mesh, config)
        if config.verbose:
            print(f"fxshard: wrote graph dumps to {config.dump_dir}", file=sys.stderr)
    return config


def _check_ranks_agree(programs: list[Program], model, batch_spec: BatchSpec, optimizer, mesh, config: Config,
                       groups: dict, stage: int, job_group=None) -> None:
    """Before anything is materialized, every rank of the mesh raises where they would issue different
    collectives, traced different steps, or start from different weights, batch shapes, optimizer or
    Config; a pipeline's stages also agree on their random streams and connect their point-to-point
    peers. `programs`: the traced program, then each pass's."""
    program = programs[-1]
    from .runtime.agreement import check_agreement, check_pipeline_streams, check_same_start, connect_pipeline_peers

    check_agreement(program.graph, groups, batch_spec.device, stage if program.stage is not None else None)
    check_same_start(model, batch_spec, optimizer, config, batch_spec.device, programs[0], job_group)
    if program.stage is not None:
        check_pipeline_streams(groups["pp"], mesh, config, program.stage.costs)
        connect_pipeline_peers(program.graph, groups["pp"], batch_spec.device)


def _transient_buffers(model: nn.Module) -> frozenset[str]:
    """The names of the model's buffers registered with persistent=False, under every path that reaches them."""
    return frozenset(f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules(remove_duplicate=False)
                     for name in module._non_persistent_buffers_set)


def _aliases(model: nn.Module) -> frozenset[str]:
    """The other names of tied parameters (lm_head.weight where it is embed_tokens.weight)."""
    canonical = {name for name, _ in model.named_parameters()}
    return frozenset(name for name, _ in model.named_parameters(remove_duplicate=False) if name not in canonical)


def _structure_of(model: nn.Module) -> nn.Module:
    """What step.evaluate traces later: a copy of `model` whose parameters and buffers are meta tensors
    of the same shapes (tracing reads nothing else of them), so that the step does not keep the
    user's model and its weights alive (under ZeRO-3 a whole unsharded copy per rank). Other tensor
    attributes are copied as they are. A model that cannot be deep-copied is kept itself, with a
    warning."""
    memo = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in memo:
            empty = tensor.detach().to("meta")
            memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    try:
        return copy.deepcopy(model, memo)
    except Exception as error:  # modules holding locks, streams, process groups: keep the model
        import warnings

        warnings.warn(f"fxshard: {type(model).__name__} cannot be deep-copied ({type(error).__name__}: "
                      f"{str(error)[:120]}), so the step keeps the model itself for step.evaluate, which traces it "
                      f"on its first call: change the model after shard() and evaluate() computes the changed "
                      f"model (training does not); it also keeps the model's weights alive", stacklevel=3)
        return model


def _check_devices(tensors: list[torch.Tensor], batch: torch.device) -> None:
    """The state lives where the batch is. A model built on the host moves there (its own tensors stay
    as they are); a model on another accelerator device than its batch is a mistake to name now, not
    a raw device error in the first step (or, on one rank only, a hang of the others)."""
    devices = {t.device for t in tensors}
    elsewhere = sorted(str(d) for d in devices if d != batch and d.type != "cpu")
    if elsewhere:
        raise FxShardError(f"the model's tensors are on {', '.join(elsewhere)} but the example batch is on {batch}; "
                           f"put the batch on the model's device (or the model on the batch's: torch.cuda.set_device "
                           f"on each rank, then build the model there)")


def _compile(model, loss_fn, example_batch, optimizer, mesh, config, stages=(0,), share=False) -> list[Program]:
    """Trace, then run the passes for each pipeline stage in `stages`: the traced program followed by
    the program after each pass, of the last stage given (Mesh(pp>1) traces one microbatch, which the
    pipeline pass cuts and schedules). With `share`, ranks that would trace the same step trace it
    once (fxshard/share.py)."""
    from fxshard.passes import run_pipeline

    pipelined = mesh is not None and mesh.pp > 1
    if pipelined:
        example_batch = _first_microbatch(example_batch, config)
        # one microbatch; a Schedule object would set microbatches back to its own count
        one = dict(schedule="1f1b", virtual_stages=1) if not isinstance(config.schedule, str) else {}
        traced_config = dataclasses.replace(config, microbatches=1, **one)
    else:
        traced_config = config
    if share:
        from .share import fingerprint, shared_trace

        digest = fingerprint(model, loss_fn, BatchSpec.from_example(example_batch), optimizer, traced_config)
        program = shared_trace(lambda: _trace(model, loss_fn, example_batch, optimizer, traced_config,
                                              balance=not pipelined), digest, config.verbose)
    else:
        program = _trace(model, loss_fn, example_batch, optimizer, traced_config, balance=not pipelined)
    return [run_pipeline(program, mesh, config, stage=stage) for stage in stages][-1]


def _shares(mesh, setting: bool | None) -> bool:
    """Config(share_trace) or Config(share_compile) on this mesh, where None means: on gloo, whose
    ranks share their host's cores (on NCCL each rank traces on its own cores, and sharing the
    compiling did not shorten it on 2 H200s)."""
    if mesh is None or mesh.size == 1:
        return False
    if setting is not None:
        return setting
    import torch.distributed as dist

    return dist.get_backend() == "gloo"


def _warn_unused_pipeline_settings(mesh, config: Config) -> None:
    """Config(schedule, virtual_stages, stage_layers) shape a pipeline: without Mesh(pp>1) they do nothing,
    which a run that meant to pipeline (the mesh forgotten) should hear."""
    if mesh is not None and mesh.pp > 1:
        return
    given = [f"{name}={getattr(config, name)!r}" for name, default in
             (("schedule", "1f1b"), ("virtual_stages", 1), ("stage_layers", None)) if getattr(config, name) != default]
    if given:
        import warnings

        warnings.warn(f"Config({', '.join(given)}) shapes a pipeline, but the mesh ({mesh or 'one device'}) has "
                      f"no pp axis: it has no effect. Pass mesh=fxshard.Mesh(pp=...) to pipeline", stacklevel=3)


def _warn_unused_moe_settings(programs: list[Program], config: Config) -> None:
    """Config(fuse_grouped_mlp, ep_overlap, moe_capacity_factor) act on MoE layers (fxshard.moe.dispatch's,
    recognized ones, experts as fxshard's grouped GEMMs): on a step with none they do nothing, which a run
    that set them should hear."""
    from fxshard.passes.recognize_moe import EXPERT_OPS

    from . import moe

    import warnings

    given = [f"{name}={getattr(config, name)!r}" for name, default in
             (("fuse_grouped_mlp", False), ("ep_overlap", False), ("moe_capacity_factor", None))
             if getattr(config, name) != default]
    if not given or any(moe.ANNOTATION in (node.meta.get("custom") or {}) or node.target in EXPERT_OPS
                        for program in programs for node in program.graph.nodes):
        fusing = [p for p in programs if p.name == "fuse_grouped_mlp"]
        if fusing and not any(p.notes.get("fused_grouped_mlp") for p in fusing):
            warnings.warn("Config(fuse_grouped_mlp=True) fused none of the step's expert MLPs: it fuses a grouped GEMM, "
                          "an activation it knows op for op (swiglu, geglu, clamped quick_geglu, gelu, relu) and a "
                          "grouped GEMM, with no bias between and no other reader of what lies between "
                          "(passes/fuse_grouped_mlp.py). The step runs them unfused", stacklevel=user_stacklevel())
        return

    warnings.warn(f"Config({', '.join(given)}) acts on MoE layers, but the step has none (no fxshard.moe.dispatch "
                  f"call, no experts run as grouped GEMMs): it has no effect", stacklevel=user_stacklevel())


def _warn_if_eval_mode(model: nn.Module) -> None:
    """A model in eval mode (transformers' from_pretrained returns one) is traced in eval mode: the
    step trains without dropout and normalizes with BatchNorm's running statistics. Said where that
    changes what the step computes."""
    if model.training:
        return
    acting = [name for name, module in model.named_modules()
              if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
              or isinstance(module, nn.modules.batchnorm._BatchNorm)]
    if acting:
        import warnings

        warnings.warn(f"the model is in eval mode (from_pretrained returns it so), so the step trains in eval mode: "
                      f"{len(acting)} dropout / BatchNorm modules ({acting[0]}, ...) act as in evaluation. Call "
                      f"model.train() before shard() to train in train mode", stacklevel=3)


def check(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None = None, mesh=None,
          config: Config | None = None) -> None:
    """Raise `FxShardError` for what `shard` would reject that is known without processes: the
    arguments, the mesh against the config, the batch's split into microbatches, tracing (a model on
    the `meta` device allocates nothing), the passes, and for `Mesh(pp>1)` the cut into stages x
    virtual stages chunks. `example_batch` is one rank's batch, as `shard` gets it.

    A launcher calls it before it spawns ranks, so a bad configuration fails once, in the launching
    process, instead of on every rank after the processes started (examples/train.py does)."""
    config = config or Config()
    optimizer = optimizer or AdamW()
    _check_arguments(model, loss_fn, optimizer, config)
    _check_mesh(mesh)
    _warn_unused_pipeline_settings(mesh, config)
    programs = _compile(model, loss_fn, example_batch, optimizer, mesh, config,
                        range(mesh.pp if mesh is not None else 1))
    _warn_unused_moe_settings(programs, config)


def _report_lowerings(step, config: Config, index: int) -> None:
    """What the runtime changed in the last program before running it (fxshard/runtime: in-place
    optimizer updates, SM carveouts, copy-engine all-to-alls; codegen's regions): a line with
    `verbose`, and with `dump_dir` the graph that actually runs, `NN_runtime.py`, and the compiled
    regions, `NN_codegen.txt`, next to the passes' dumps."""
    line = f"fxshard: {step.lowerings()}"
    if config.verbose:
        print(line, file=sys.stderr)
    if config.dump_dir:
        from .dump import write_dump_file

        write_dump_file(config.dump_dir, f"{index:02d}_runtime.py", f"# {line}\n# the graph CompiledStep runs "
                        f"(CUDA graphs, if on, capture this)\n" + step.runtime_code())
        if step.codegen is not None:
            write_dump_file(config.dump_dir, f"{index:02d}_codegen.txt", step.codegen.table())


def _process_groups(mesh: Mesh | None, timeout_s: float, ctas_of=lambda axis: None, high_priority: bool = False):
    """Axis -> this rank's process group, and axis -> this rank's index along it. fxshard makes its own
    groups (every rank creates every group, in the same order), with `timeout_s` on each wait and, on
    NCCL, at most `ctas_of(axis)` CTAs per collective (Config.nccl_ctas), on high-priority streams with
    `high_priority` (Config.nccl_high_priority)."""
    if mesh is None:
        return {}, {}
    _check_mesh(mesh)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise FxShardError(
            f"{mesh} needs torch.distributed initialized with {mesh.size} processes: launch with "
            f"`torchrun --nproc-per-node {mesh.size} ...` (or examples/train.py --dp {mesh.dp})")
    if dist.get_world_size() != mesh.size:
        raise FxShardError(f"{mesh} has {mesh.size} ranks but the process group has {dist.get_world_size()}; "
                           f"make them agree")
    # every rank makes every group: ranks that were given another mesh or timeout would wait in
    # torch's store for groups nobody else makes (collective_timeout_s, then a store error)
    ours = (str(mesh), timeout_s, [ctas_of(axis) for axis in ("pp", "dp", "ep")], high_priority)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours)
    other = next((rank for rank, theirs in enumerate(everyone) if theirs != ours), None)
    if other is not None:
        raise FxShardError(f"rank {dist.get_rank()} shards with {mesh}, collective_timeout_s={timeout_s}, "
                           f"nccl_max_ctas {ours[2]}, nccl_high_priority={high_priority}; rank {other} with "
                           f"{everyone[other][0]}, collective_timeout_s={everyone[other][1]}, nccl_max_ctas "
                           f"{everyone[other][2]}, nccl_high_priority={everyone[other][3]}: give every rank the same "
                           f"Mesh and Config")
    return _new_groups(mesh.all_groups(), timeout_s, ctas_of, high_priority), mesh.coords(dist.get_rank())


def _job_group(timeout_s: float):
    """A gloo group of every rank whose waits time out after `timeout_s` (Config.collective_timeout_s),
    for what every rank does together outside the step (the lr agreement of parameters() / state_dict()
    / save, checkpoints, the non-finite error's gather, evaluate()'s first compile): without it those
    waited the default group's timeout (30 minutes on gloo) for a stalled peer. Made at shard, where
    every rank is, once per process and timeout (as _new_groups); gloo, so it holds no GPU resources."""
    import datetime

    import torch.distributed as dist

    world = dist.group.WORLD
    key = (id(world), "job", tuple(range(dist.get_world_size())), timeout_s, "gloo")
    if key not in _GROUPS:
        try:
            group = dist.new_group(list(range(dist.get_world_size())), backend="gloo",
                                   timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as error:  # a build or host without gloo: the default group's waits
            import warnings

            warnings.warn(f"fxshard: no gloo group for the ranks' agreements outside the step ({error}); they wait "
                          f"on the default process group, for its timeout", stacklevel=3)
            group = None
        _GROUPS[key] = (world, group)
    return _GROUPS[key][1]


# (default group's id, axis, ranks, timeout, NCCL's max CTAs and priority) -> (that default group, the group): what
# _new_groups made in this process. The default group is held so that its id cannot name a later one.
_GROUPS: dict[tuple, tuple] = {}


def _new_groups(rank_lists: dict[str, list[list[int]]], timeout_s: float, ctas_of=lambda axis: None,
                high_priority: bool = False) -> dict:
    """Axis -> this rank's process group among `rank_lists[axis]` (global ranks). Every rank creates
    every group, in the same order, as torch.distributed requires; each wait times out after `timeout_s`;
    on NCCL, each collective or transfer runs on at most `ctas_of(axis)` CTAs (None: NCCL's choice), on
    a high-priority stream with `high_priority`.
    A group is made once per process (per default group, axis, ranks, timeout, CTAs and priority) and every later
    `shard()` reuses it: each group holds NCCL communicators and, with copy-engine collectives, a
    symmetric workspace, which piled up with every call (1.1 GiB of workspaces in one MoE benchmark
    process). Every rank makes the same calls in the same order, so every rank reuses the same ones."""
    import datetime

    import torch.distributed as dist

    rank, timeout, world = dist.get_rank(), datetime.timedelta(seconds=timeout_s), dist.group.WORLD
    groups = {}
    for axis, lists in rank_lists.items():
        nccl = dist.get_backend() == "nccl"
        max_ctas, priority = (ctas_of(axis), high_priority) if nccl else (None, False)
        options = _nccl_options(max_ctas, priority) if max_ctas is not None or priority else None
        for ranks in lists:
            key = (id(world), axis, tuple(ranks), timeout_s, max_ctas, priority)
            if key not in _GROUPS:
                _GROUPS[key] = (world, dist.new_group(ranks, timeout=timeout, pg_options=options))
            if rank in ranks:
                groups[axis] = _GROUPS[key][1]
    return groups


def _nccl_options(max_ctas: int | None, high_priority: bool = False):
    """ProcessGroupNCCL options whose communicators run each collective on at most `max_ctas` CTAs (None:
    NCCL's choice), on a high-priority stream with `high_priority`."""
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high_priority
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
        if options.config.min_ctas > max_ctas:  # unset is negative (NCCL's default, 1)
            options.config.min_ctas = max_ctas
    return options


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hf_config(model: nn.Module) -> dict | None:
    """A transformers model's config as a dict (what load_hf checks a directory against), else None."""
    config = getattr(model, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") and isinstance(getattr(config, "model_type", None), str) \
        else None


def _expert_layouts(model: nn.Module) -> dict:
    """Module prefix ("layers.0.moe.experts.fc1.") -> (ExpertLayout, experts) for each expert layer that
    declares its storage layout (models.GroupedLinear): checkpoints convert between layouts."""
    from .checkpoint import ExpertLayout

    return {f"{name}.": (module.layout, module.experts) for name, module in model.named_modules()
            if isinstance(getattr(module, "layout", None), ExpertLayout) and isinstance(getattr(module, "experts", None), int)}


def _one_process(mesh):
    """A mesh of one rank outside torch.distributed is one device: Mesh(dp=1) needs no launcher."""
    import torch.distributed as dist

    if isinstance(mesh, Mesh) and mesh.size == 1 and not (dist.is_available() and dist.is_initialized()):
        return None
    return mesh


def _refuse_no_mesh_in_a_job(mesh) -> None:
    """No mesh inside a process group of several ranks would train a copy of the model on each rank,
    silently, and a save would then write a mixture of them (each rank writes part of the tensors)."""
    import torch.distributed as dist

    if mesh is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        raise FxShardError(
            f"shard() was given no mesh, in a process group of {world} ranks: each rank would train its own "
            f"copy of the model and a save would mix them. Pass the job's mesh, e.g. mesh=fxshard.Mesh(dp={world}) "
            f"(its sizes multiply to {world}); for independent single-device runs, start the processes without "
            f"torch.distributed")


def _check_mesh(mesh) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise FxShardError(f"mesh must be fxshard.Mesh(dp=...), got {type(mesh).__name__}")


def _pipeline_batch_check(mesh, groups, program, device):
    """On a pipeline's ranks, the check the first step runs on its batch (runtime/agreement.py
    check_pipeline_batch): the example batch may be a placeholder, the first real one may not."""
    if not groups or program.stage is None:
        return None
    from .runtime.agreement import check_pipeline_batch

    return lambda batch: check_pipeline_batch(batch, mesh, device)


def _first_microbatch(example_batch, config: Config):
    """Mesh(pp>1): the first of the `config.microbatches` pieces the pipeline splits each batch into."""
    rows = BatchSpec.from_example(example_batch).split_rows(config.microbatches)
    return torch.utils._pytree.tree_map(lambda t: t[:rows] if isinstance(t, torch.Tensor) else t, example_batch)


def _stage_groups(program: Program, mesh: Mesh, timeout_s: float, ctas_of=lambda axis: None,
                  high_priority: bool = False) -> dict:
    """Process groups of the stage subsets the stage programs name (a weight tied across some of the
    stages; the plan lists every stage's, so every rank creates the same groups). They carry the
    pipeline's collectives: Config(nccl_max_ctas={"pp": N}) limits them as it does the pp groups."""
    return _new_groups({axis: mesh.stage_groups(stages) for axis, stages in program.stage.groups if axis != "pp"},
                       timeout_s, lambda axis: ctas_of("pp"), high_priority)


def _dump_schedule(programs: list[Program], mesh: Mesh, config: Config) -> None:
    """The schedule next to the stage's programs: `pipeline.txt` and the simulator's `pipeline.svg`."""
    from fxshard.passes import lowered_schedule

    from .dump import dump_schedule

    schedule, pairs = lowered_schedule(mesh, config, programs[-1].stage.costs)
    dump_schedule(schedule, programs[-1].stage, config.dump_dir, pairs, config.p2p_receives)


def _check_arguments(model, loss_fn, optimizer, config) -> None:
    if not isinstance(model, nn.Module):
        raise FxShardError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise FxShardError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    if optimizer is not None and not isinstance(optimizer, (AdamW, SGD)):
        raise FxShardError(
            f"optimizer must be fxshard.optim.AdamW(...) or fxshard.optim.SGD(...), got "
            f"{type(optimizer).__name__}; torch.optim optimizers run outside the graph")
    if config is not None and not isinstance(config, Config):
        raise FxShardError(f"config must be fxshard.Config(...), got {type(config).__name__}")

