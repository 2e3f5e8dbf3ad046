"""The compiler pipeline: the ordered list of passes, each switched on by config and nothing else.

A pass is `(program, mesh, config) -> program`, pure, with a docstring that states its invariant.
The pipeline pass (Mesh(pp>1)) runs from fxshard.api, on the program these produce.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from fxshard.program import Program

from .ep import EPConfig, expert_parallel
from .fsdp import FSDPConfig, fsdp
from .fuse_grouped_mlp import fuse_grouped_mlp
from .interleave import interleave_microbatches
from .narrow_grads import narrow_grads
from .overlap import fill_ep_windows


class Pass(NamedTuple):
    name: str
    run: Callable  # (program, mesh, config) -> program
    is_enabled: Callable  # (mesh, config) -> bool


PIPELINE: list[Pass] = [
    # before sharding: it rewrites one device's math, and FSDP then shards whatever ops it finds
    Pass("fuse_grouped_mlp",
         lambda program, mesh, config: fuse_grouped_mlp(program),
         lambda mesh, config: config.fuse_grouped_mlp),
    # per-rank expert computation and all-to-alls; FSDP then shards experts over edp, the rest over dp
    Pass("ep",
         lambda program, mesh, config: expert_parallel(
             program, EPConfig(mesh.ep, config.ep_chunks if config.ep_overlap else 1)),
         lambda mesh, config: mesh is not None and mesh.ep > 1),
    Pass("fsdp",
         lambda program, mesh, config: fsdp(program, FSDPConfig(mesh.dp, config.sharding, config.fsdp_prefetch,
                                                                ep=mesh.ep)),
         lambda mesh, config: mesh is not None),
    # reorders: independent work (delayed weight gradients, a shared expert) into the all-to-all windows
    Pass("overlap",
         lambda program, mesh, config: fill_ep_windows(program),
         lambda mesh, config: mesh is not None and mesh.ep > 1 and config.ep_overlap),
    # last: reorders whatever the passes above produced; two microbatches alternate at all-to-alls
    Pass("interleave",
         lambda program, mesh, config: interleave_microbatches(program, config.ep_interleave),
         lambda mesh, config: mesh is not None and mesh.ep > 1 and config.ep_overlap and config.microbatches > 1),
    # one device, low-precision compute: nothing reduces the gradients, the optimizer reads them as they are
    Pass("narrow_grads",
         lambda program, mesh, config: narrow_grads(program),
         lambda mesh, config: mesh is None and config.param_dtype is not None),
]


def run_pipeline(program: Program, mesh, config, pipeline: list[Pass] | None = None) -> list[Program]:
    """The traced program followed by the program after each enabled pass, in order."""
    programs = [program]
    for step in PIPELINE if pipeline is None else pipeline:
        if step.is_enabled(mesh, config):
            programs.append(step.run(programs[-1], mesh, config).replace(name=step.name))
    return programs
