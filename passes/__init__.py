"""The compiler pipeline: the ordered list of passes, each switched on by config and nothing else.

A pass is `(program, mesh, config, stage) -> program`, pure, with a docstring that states its
invariant; `stage` is the pipeline stage the program is for (0 without a pipeline): from the
`pipeline` pass on, each stage of Mesh(pp>1) has its own program, and the passes after it run on
that per-rank program like on any other.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from fxshard.program import Program

from .causal_attention import causal_attention
from .ep import EPConfig, expert_parallel
from .flash_attention import flash_attention
from .fsdp import FSDPConfig, fsdp
from .fuse_grad_accumulation import fuse_grad_accumulation
from .fuse_grouped_mlp import fuse_grouped_mlp
from .interleave import interleave_actions, interleave_microbatches
from .lower_schedule import lower_schedule
from .narrow_grads import narrow_grads
from .overlap import fill_ep_windows
from .recognize_moe import recognize_moe
from .recompute import recompute
from .recompute_pointwise import recompute_pointwise, runs_on
from .pipeline import chunk_costs, split_stages


class Pass(NamedTuple):
    name: str
    run: Callable  # (program, mesh, config, stage) -> program
    is_enabled: Callable  # (mesh, config) -> bool


PIPELINE: list[Pass] = [
    # attention masks that are the causal pattern (built by the model's own code) -> is_causal
    Pass("causal_attention",
         lambda program, mesh, config, stage: causal_attention(program),
         lambda mesh, config: True),
    # CUDA attention on the memory-efficient kernel with no mask left or a sliding window -> flash
    Pass("flash_attention",
         lambda program, mesh, config, stage: flash_attention(program),
         lambda mesh, config: True),
    # MoE layers written with plain torch ops (transformers, torchtitan): their facts, for the ep pass
    Pass("recognize_moe",
         lambda program, mesh, config, stage: recognize_moe(program, config.moe_capacity_factor),
         lambda mesh, config: mesh is not None and mesh.ep > 1),
    # before sharding: it rewrites one device's math, and FSDP then shards whatever ops it finds
    Pass("fuse_grouped_mlp",
         lambda program, mesh, config, stage: fuse_grouped_mlp(program),
         lambda mesh, config: config.fuse_grouped_mlp),
    # per-rank expert computation and all-to-alls; FSDP then shards experts over edp, the rest over dp
    Pass("ep",
         lambda program, mesh, config, stage: expert_parallel(
             program, EPConfig(mesh.ep, config.ep_chunks if config.ep_overlap else 1)),
         lambda mesh, config: mesh is not None and mesh.ep > 1),
    # activation checkpointing: the backward computes again what it reads from inside checkpointed
    # calls (after ep, whose collectives and custom ops it leaves to be read; before the cut)
    Pass("recompute",
         lambda program, mesh, config, stage: recompute(program),
         lambda mesh, config: True),
    # what the backward reads and pointwise ops, views and casts make: computed again where a minimum cut
    # keeps fewer bytes (after recompute, whose copies it leaves; before the cut, which keeps each
    # layer's copies in its chunk)
    Pass("recompute_pointwise",
         lambda program, mesh, config, stage: recompute_pointwise(program) if runs_on(program, config) else program,
         lambda mesh, config: config.recompute_pointwise is not False),
    # Mesh(pp>1): the microbatch program cut into chunks, and this stage's actions of the schedule
    # lowered into one program for the whole step (sends, receives, accumulation, optimizer phase)
    Pass("pipeline",
         lambda program, mesh, config, stage: _pipeline(program, mesh, config, stage),
         lambda mesh, config: mesh is not None and mesh.pp > 1),
    # with microbatches: each weight gradient's accumulation done by its matmul (bf16 compute, fp32 totals)
    Pass("fuse_grad_accumulation",
         lambda program, mesh, config, stage: fuse_grad_accumulation(program),
         lambda mesh, config: config.fuse_grad_accumulation and config.microbatches > 1),
    Pass("fsdp",
         lambda program, mesh, config, stage: fsdp(program, FSDPConfig(mesh.dp, config.sharding, config.fsdp_prefetch,
                                                                ep=mesh.ep)),
         lambda mesh, config: mesh is not None),
    # reorders: independent work (delayed weight gradients, a shared expert) into the all-to-all windows
    Pass("overlap",
         lambda program, mesh, config, stage: fill_ep_windows(program),
         lambda mesh, config: mesh is not None and mesh.ep > 1 and config.ep_overlap),
    # last: reorders whatever the passes above produced; two microbatches alternate at all-to-alls
    # (in a pipeline: each forward/backward pair of the stage's combined 1F1B schedule)
    Pass("interleave",
         lambda program, mesh, config, stage: _interleave(program, mesh, config, stage),
         lambda mesh, config: _interleaves(mesh, config)),
    # low-precision compute: gradients nothing reduces (one device, FSDP units on one-rank axes) reach
    # the optimizer as they are
    Pass("narrow_grads",
         lambda program, mesh, config, stage: narrow_grads(program),
         lambda mesh, config: config.param_dtype is not None),
]


def _pipeline(program: Program, mesh, config, stage: int) -> Program:
    schedule, _ = lowered_schedule(mesh, config)
    pipeline = split_stages(program, schedule.chunks, config.stage_layers)
    costs = tuple(chunk_costs(pipeline, schedule).items())
    schedule, pairs = lowered_schedule(mesh, config, costs)
    return lower_schedule(pipeline, schedule, stage, pairs, config.p2p_receives, costs)


def _interleaves(mesh, config) -> bool:
    return mesh is not None and mesh.ep > 1 and config.ep_overlap and config.microbatches > 1


def _interleave(program: Program, mesh, config, stage: int) -> Program:
    if mesh.pp == 1:
        return interleave_microbatches(program, config.ep_interleave)
    _, pairs = lowered_schedule(mesh, config, program.stage.costs)
    return interleave_actions(program, [(str(first), str(second)) for first, second in pairs[stage]])


def lowered_schedule(mesh, config, costs: tuple = ()):
    """The schedule the pipeline pass lowers and each rank's pairs of actions that run interleaved:
    with Mesh(dp>1), ZeRO's collectives as actions (`zero_schedule`); with Mesh(ep>1) and
    `ep_overlap`, the combined 1F1B (fxshard.schedule.combine_pairs), else no pairs. `costs`: the
    items of the chunk costs the lowering orders transfers by (`StagePlan.costs`); the pairs hold
    for that order, with receives where Config(p2p_receives) puts them."""
    from fxshard import schedule
    from fxshard.errors import FxShardError

    plan = zero_schedule(pipeline_schedule(mesh, config), mesh, config)
    if not _interleaves(mesh, config):
        return plan, tuple(() for _ in plan.ranks)
    if config.ep_interleave != "combined-1f1b":
        raise FxShardError(f"ep_interleave={config.ep_interleave!r} pairs two microbatches' forwards, but with "
                           f"Mesh(pp>1) the pipeline schedule orders the microbatches; use "
                           f"ep_interleave='combined-1f1b' (each stage's forward and backward pairs) or ep_overlap=False")
    return schedule.combine_pairs(plan, costs, config.p2p_receives)


def zero_schedule(plan, mesh, config):
    """`plan` with the collectives the fsdp pass issues over dp as actions (fxshard.schedule.
    add_zero_actions), where there is a dp axis: every strategy reduces each chunk's gradients (G);
    ZeRO-3 (`optim_grads_params`) also gathers each chunk's parameters (U) and frees them (R), U
    `fsdp_prefetch` compute actions ahead. A schedule that has ZeRO actions already (a user's own)
    keeps them, if the strategy asks for the same kinds."""
    from fxshard import schedule
    from fxshard.errors import FxShardError

    if mesh.dp == 1:
        return plan
    unshard = config.sharding == "optim_grads_params"
    kinds = {a.kind for actions in plan.ranks for a in actions} & set(schedule.ZERO)
    if not kinds:
        return schedule.add_zero_actions(plan, unshard, config.fsdp_prefetch)
    wanted = {"U", "R", "G"} if unshard else {"G"}
    if kinds != wanted:
        raise FxShardError(f"the schedule's ZeRO actions are {sorted(kinds)}, but sharding={config.sharding!r} over "
                           f"dp={mesh.dp} issues {sorted(wanted)}; leave them out of the schedule (fxshard adds them) "
                           f"or write {' / '.join(sorted(wanted))} for every chunk")
    return plan


def pipeline_schedule(mesh, config):
    """The schedule Config names, for the mesh's stages (fxshard.schedule), or the one it holds."""
    from fxshard import schedule
    from fxshard.errors import FxShardError

    if isinstance(config.schedule, schedule.Schedule):
        if config.schedule.stages != mesh.pp:
            raise FxShardError(f"Config(schedule=...) is a schedule for {config.schedule.stages} stages, but the "
                               f"mesh has pp={mesh.pp}")
        user = config.schedule
        if not any(a.kind in schedule.TRANSFERS for actions in user.ranks for a in actions):
            compute = [[a for a in actions if a.kind in schedule.COMPUTE + schedule.ZERO] for actions in user.ranks]
            user = schedule.add_communication(compute, user.stages, user.virtual, user.microbatches, user.name,
                                              user.placement)
        return user
    # the combined 1F1B pairs a forward with a backward, and its activation leaves after both: one more
    # warm-up forward per rank keeps the next stage fed (Megatron's +1; fxshard.schedule.combine_pairs)
    combined = _interleaves(mesh, config) and config.ep_interleave == "combined-1f1b"
    return schedule.build(config.schedule, mesh.pp, config.microbatches, config.virtual_stages,
                          extra_warmup=1 if combined else 0)


def run_pipeline(program: Program, mesh, config, pipeline: list[Pass] | None = None, stage: int = 0) -> list[Program]:
    """The traced program followed by the program after each enabled pass, in order (for pipeline
    stage `stage` under Mesh(pp>1)). A pass that hands back its input unchanged (nothing to
    rewrite) adds no program."""
    from fxshard import schedule
    from fxshard.errors import FxShardError

    stages = mesh.pp if mesh is not None else 1
    if isinstance(config.schedule, schedule.Schedule) and config.schedule.stages != stages:
        # with pp=1 no pipeline pass runs to say so: the schedule would be dropped without a word
        raise FxShardError(f"Config(schedule=...) is a schedule for {config.schedule.stages} stages, but the mesh has "
                           f"pp={stages}; use Mesh(pp={config.schedule.stages}) or a schedule for {stages} stages")
    programs = [program]
    for step in PIPELINE if pipeline is None else pipeline:
        if step.is_enabled(mesh, config):
            result = step.run(programs[-1], mesh, config, stage)
            if result is not programs[-1]:
                programs.append(result.replace(name=step.name))
    return programs
