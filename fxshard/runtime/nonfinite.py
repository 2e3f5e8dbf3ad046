"""The error Config(nonfinite="raise") raises: which step, and the first parameter whose gradient was
not finite, found from every rank's flags (each rank flags only the gradients it holds: its shards,
its experts, its pipeline stage's parameters)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.fx as fx

from .. import meta
from ..graph import Graph, lazy_module
from ..errors import FxShardError
from ..program import InputKind, OutputKind, Program


def was_skipped(flags: torch.Tensor) -> torch.Tensor:
    """Whether the step was skipped (0-d bool): the program's own decision, the flags' first entry
    (optimizer_graph.append_update); the rest say which of this rank's gradients were not finite."""
    return flags[0]


def flagged(step, flags: torch.Tensor) -> list[tuple[int, str]]:
    """This rank's tensors whose gradient was not finite, as (position of its first parameter in the
    model, description with a {rank} field), in model order."""
    program = step.program
    (position,) = [i for i, spec in enumerate(program.outputs) if spec.kind is OutputKind.NONFINITE]
    names = program.output_nodes()[position].meta[meta.NONFINITE_TENSORS]
    order = {spec.name: i for i, spec in enumerate(step.programs[0].inputs) if spec.kind is InputKind.PARAM}
    units = {unit.name: unit for unit in program.units}  # FSDP's optimizer updates units' shards
    found = []
    for name, bad in zip(names, flags[1:].tolist()):  # flags[0]: whether the step was skipped
        if not bad:
            continue
        unit = units.get(name)
        if unit is None:
            found.append((order.get(name, len(order)), f"{name} (on rank {{rank}})"))
        else:
            members = [m.name for m in unit.members]
            listed = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
            found.append((min(order.get(m, len(order)) for m in members),
                          f"in FSDP unit {unit.name!r} ({listed}), in its shard on rank {{rank}}"))
    return sorted(found)


def nonfinite_error(step, number: int, last: int, grad_norm: float, flags: torch.Tensor) -> FxShardError:
    """The error for step `number` (1-based; `last` ran so far), the same text on every rank (every
    rank calls this: the gradient norm that decided is global)."""
    import torch.distributed as dist

    mine = [(position, step.rank, text) for position, text in flagged(step, flags)]
    everyone = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        group = getattr(step, "job_group", None)  # gloo, timed out after collective_timeout_s
        with (torch.cuda.device(step.device) if step.device.type == "cuda" else contextlib.nullcontext()):
            from .agreement import waiting_for_peers

            with waiting_for_peers("the gather of the non-finite gradients' names", group):
                dist.all_gather_object(everyone, mine, group=group)  # NCCL's object transfer uses the current device
    found = sorted(entry for entries in everyone for entry in entries)
    what = "the gradients are not finite"
    if found:
        _, rank, text = found[0]
        where = f"the first parameter whose gradient is not finite is {text.format(rank=rank)}"
    elif math.isfinite(grad_norm):  # decided from the unreduced gradients (optimizer_graph.Deferred)
        what = "the gradients are too large to check"
        where = ("the squares of some rank's gradients before their reduce-scatter overflow float32 "
                 "(values near 1e19), although their mean over the ranks does not")
    else:
        where = "no rank found a non-finite gradient of its own (the norm's reduction overflowed)"
    after = (f"those after step {number - 1}" if last == number else
             f"those after step {last} (step {number + 1}" + (f" to {last}" if last > number + 1 else "") +
             " ran before this check; metrics['skipped'] says which of them applied its update)")
    return FxShardError(
        f"step {number}: {what} (grad norm {grad_norm}); {where}. That step's update "
        f"was not applied: parameters, optimizer state and updated buffers are {after}. Look for a NaN or inf in "
        f"that step's batch, a learning rate that diverges, or an overflow in the model; "
        f"Config(nonfinite='skip') skips such steps and goes on (metrics['skipped'])")


def keep_buffers_when_skipped(run: fx.GraphModule, program: Program) -> tuple[fx.GraphModule, int]:
    """`run` (the program's graph, outputs in `program.outputs`' order) with each buffer the step
    updates (BatchNorm's running statistics, counters) kept as it was where the step was skipped:
    its output becomes where(skipped, the buffer as read, its update). A skipped step then leaves the
    whole training state as it was; without this a NaN batch would write NaN statistics that later
    steps and evaluation read, while the parameters stayed finite. Returns (graph module, how many
    buffers); `run` itself where the program has no non-finite guard or updates no buffer."""
    outputs = program.outputs
    flags = [i for i, spec in enumerate(outputs) if spec.kind is OutputKind.NONFINITE]
    buffers = [(i, spec.name) for i, spec in enumerate(outputs) if spec.kind is OutputKind.BUFFER]
    if not flags or not buffers:
        return run, 0
    graph = Graph()  # a copy: `run` may be the program's own module
    graph.output(graph.graph_copy(run.graph, {}))
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    read = {spec.name: node for spec, node in zip(program.inputs, placeholders) if spec.kind is InputKind.BUFFER}
    output = graph.output_node()
    values = list(output.args[0])
    with graph.inserting_before(output):
        skipped = graph.call_function(torch.ops.aten.select.int, (values[flags[0]], 0, 0))
        skipped.meta[meta.PHASE] = meta.OPTIM
        for index, name in buffers:
            kept = graph.call_function(torch.ops.aten.where.self, (skipped, read[name], values[index]))
            kept.meta[meta.PHASE] = meta.OPTIM
            values[index] = kept
    output.args = (tuple(values),)
    graph.lint()
    return lazy_module(run, graph), len(buffers)
