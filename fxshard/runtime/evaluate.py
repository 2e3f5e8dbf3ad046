"""Evaluation steps: the forward and the loss of a compiled step, in eval mode, nothing updated.

`step.evaluate(batch)` compiles, on its first call, the same training step again with the model in
eval mode (dropout off, BatchNorm on its running statistics), through the same passes, so the
program reads the training state exactly as the training program does (FSDP units gathered,
experts exchanged, pipeline stages sending activations), and then keeps only what the loss and the
metrics need (`forward_only`). Every later call replays that program on the live state.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import meta
from ..errors import FxShardError
from ..graph import Graph, ancestors, lazy_module
from ..program import InputKind, OutputKind, Program

_c10d = torch.ops._c10d_functional
_SEND = torch.ops.fxshard.send.default
_REPORTED = (OutputKind.LOSS, OutputKind.METRIC)


def forward_only(program: Program) -> Program:
    """The part of `program` its loss and metrics need: no backward, no optimizer, no state outputs.

    Invariant: given the same inputs, the result computes the same loss and metrics as `program`
    (the same nodes, in the same order, a subset of them) and updates nothing. The forward's sends
    of a pipeline stage stay with their waits (a later stage's loss reads what they carry) and so do
    the receives the kept forward reads; the backward's transfers go on both sides of each pair, and
    a collective stays on every rank of its group or on none (the ranks run the same program).
    Inputs are kept as they are, so the evaluation reads the training state by the same names.
    """
    graph = program.graph
    reported = [(spec, node) for spec, node in zip(program.outputs, program.output_nodes()) if spec.kind in _REPORTED]
    sends = [n for n in graph.nodes if n.target is _SEND and meta.phase(n) == meta.FWD]
    keep = ancestors([node for _, node in reported] + sends)
    keep |= {user for send in sends for user in send.users if user.target is _c10d.wait_tensor.default}
    new = Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in keep:
            env[node] = new.node_copy(node, lambda n: env[n])
    new.output(tuple(env[node] for _, node in reported))
    new.lint()
    return program.replace(graph_module=lazy_module(program.graph_module, new),
                           outputs=tuple(spec for spec, _ in reported), name="evaluate",
                           notes=dict(program.notes, evaluate=f"{len(keep)} of {len(graph.nodes)} nodes kept: "
                                                              f"the loss and the metrics, in eval mode"))


def check_reads_training_state(evaluation: Program, training: Program, state: dict) -> None:
    """The evaluation program must read the training state by the names, and in the flat layouts,
    that the training program gave it."""
    stateful = (InputKind.PARAM, InputKind.OPT_STATE, InputKind.BUFFER)
    missing = [spec.name for spec in evaluation.inputs if spec.kind in stateful and (spec.kind, spec.name) not in state]
    missing += [f"unit {unit.name}" for unit in evaluation.units if unit not in training.units]
    if missing:
        raise FxShardError(
            f"the evaluation program reads state the training step does not hold ({', '.join(missing[:5])}): the "
            f"model traced in eval mode cut its parameters differently; please report this with the model")


class EvalMode:
    """`model` in eval mode for the duration (every submodule), then each module's own mode again."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self):
        self.modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc):
        for module, training in self.modes:
            module.training = training
