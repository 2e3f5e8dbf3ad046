"""Interleave one microbatch's backward with the next microbatch's forward (combined fwd/bwd order).

With gradient accumulation the traced step runs forward 0, backward 0, forward 1, backward 1, ...
Backward m and forward m+1 do not depend on each other, so their nodes may be ordered freely
against each other. This pass merges the two into one sequence that switches from one to the other
right after a communication is issued (an all-to-all of the expert-parallel pass, or any other
collective): while one microbatch's tokens travel, the other microbatch computes. It is Megatron's
combined 1F1B overlap of expert-parallel all-to-alls, as a reordering of one rank's graph, and it
uses the pieces the EP pass marks (`meta.MOE_PIECE`): the switch points are its dispatches and
combines.

Invariant: the output graph has the same nodes with the same arguments, in another topological
order, so it computes the same values bit for bit. A node is only ever moved earlier together with
everything it reads (pulled up), never ahead of its inputs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.program import Program

_c10d = torch.ops._c10d_functional
_ISSUES = {_c10d.all_to_all_single.default, _c10d.all_gather_into_tensor.default,
           _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default}


def interleave_microbatches(program: Program) -> Program:
    """Reorder `program` so that backward m and forward m+1 alternate at communication issues."""
    nodes = list(program.graph.nodes)
    microbatches = 1 + max(meta.microbatch(n) for n in nodes)
    order = nodes
    for m in range(microbatches - 1):
        order = _merge_pair(order, m)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    notes = dict(program.notes, interleave=f"backward m interleaved with forward m+1 at communication issues, "
                                            f"{microbatches} microbatches")
    return program.replace(graph_module=fx.GraphModule(program.graph_module, graph), notes=notes)


def _merge_pair(order: list[fx.Node], m: int) -> list[fx.Node]:
    backward = [n for n in order if meta.phase(n) == meta.BWD and meta.microbatch(n) == m and n.op != "placeholder"]
    forward = [n for n in order if meta.phase(n) == meta.FWD and meta.microbatch(n) == m + 1
               and n.op != "placeholder"]
    if not backward or not forward:
        return order
    start = order.index(backward[0])
    placed: list[fx.Node] = []
    done: set[fx.Node] = set(order[:start])

    def place(node):  # with whatever it reads that is not placed yet (pulled up, in their order)
        stack, pending = [node], []
        while stack:
            current = stack.pop()
            if current in done:
                continue
            missing = [i for i in current.all_input_nodes if i not in done]
            if missing:
                stack.append(current)
                stack.extend(missing)
                continue
            done.add(current)
            pending.append(current)
        placed.extend(pending)

    queues, turn = [backward, forward], 0
    positions = [0, 0]
    while positions[0] < len(backward) or positions[1] < len(forward):
        if positions[turn] >= len(queues[turn]):
            turn = 1 - turn
        node = queues[turn][positions[turn]]
        positions[turn] += 1
        if node in done:
            continue
        place(node)
        if node.target in _ISSUES:
            turn = 1 - turn
    placed += [n for n in order[start:] if n not in done]
    return order[:start] + placed
