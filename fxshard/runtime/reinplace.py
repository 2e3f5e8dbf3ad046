"""Lowering for execution: functional optimizer updates become in-place ones where that is safe.

The traced program is functional: `fxshard::adamw_update(p, g, m, v, ...)` returns new tensors, and
the runtime makes them the next step's state. Under CUDA graphs the state must stay at fixed
addresses, so each new tensor would be copied back into its input: for AdamW that is three extra
full passes over parameters and moments every step (~5 ms per step for a 1B model on an H200).
`reinplace` rewrites such a node into `fxshard::adamw_update_`, which writes into its inputs.
Under ZeRO-1/2 the parameter argument is this rank's shard, a temporary gathered out of the flat
parameter; the moments are still inputs and are updated in place, the shard where it lies.

Invariant: the lowered graph computes the same outputs as the program's graph, where an output that
was the new value of an input is now that input itself, updated. A node is rewritten only when its
moments are graph inputs (placeholders) that every other reader reads before it, in graph order,
and its parameter is such an input too or a temporary that nothing else reads: the eager runtime
executes nodes in that order, so no reader sees an updated value.
The lowering runs after every pass and is not a pass: passes and dumps keep the functional form.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import is_view
from ..ops.adamw import adamw_update, adamw_update_  # noqa: F401  (registers both ops)

_FUNCTIONAL = torch.ops.fxshard.adamw_update.default
_IN_PLACE = torch.ops.fxshard.adamw_update_.default
_MUTATED = {0: "param", 2: "exp_avg", 3: "exp_avg_sq"}  # argument position -> name; outputs 0, 1, 2


def reinplace(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` with every safe AdamW update done in place; and how many were."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    order = {node: position for position, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _FUNCTIONAL or node.kwargs:
            continue
        targets = [node.args[position] for position in _MUTATED]
        param, *moments = targets
        if not (_last_read_by(param, node, order) or _temporary(param, node)):
            continue
        if not all(_last_read_by(target, node, order) for target in moments):
            continue
        if len(set(targets)) != len(targets):
            continue
        with graph.inserting_before(node):
            graph.call_function(_IN_PLACE, node.args)
        for user in list(node.users):
            if user.target is not operator.getitem:
                break
            user.replace_all_uses_with(targets[user.args[1]])
            graph.erase_node(user)
        else:
            graph.erase_node(node)
            rewritten += 1
            continue
        raise AssertionError(f"{node.name}: a user of adamw_update that is not a getitem: {list(node.users)}")
    graph.lint()
    return fx.GraphModule(graph_module, graph), rewritten


def _last_read_by(value: fx.Node, node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """`value` is a placeholder that nothing reads after `node`: neither the value itself nor any view
    of it (a metric that is a parameter, `detach` then `view`, is read by the output, after the update)."""
    if not (isinstance(value, fx.Node) and value.op == "placeholder"):
        return False
    pending = [value]
    while pending:
        for user in pending.pop().users:
            if user is node:
                continue
            if order[user] > order[node]:
                return False
            if is_view(user):
                pending.append(user)
    return True


def _temporary(value: fx.Node, node: fx.Node) -> bool:
    """`value` is fresh memory (or views of it) computed in the graph and read by `node` only, such as
    ZeRO-1's shard of a flat parameter (an index_select): updating it in place changes nothing else."""
    reader = node
    while isinstance(value, fx.Node) and value.op == "call_function" and hasattr(value.target, "_schema"):
        if any(user is not reader for user in value.users):
            return False
        if not is_view(value):
            return True  # a new tensor
        reader, value = value, value.args[0]  # a view: what it views must be temporary as well
    return False
