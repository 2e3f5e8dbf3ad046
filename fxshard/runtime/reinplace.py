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

`accumulate_in_place` does it for gradient accumulation fused into the weight-gradient GEMM
(`Config(fuse_grad_accumulation)`): `fxshard::matmul_accumulate(total, a, b)` becomes
`fxshard::matmul_accumulate_`, the GEMM adding into the total where it lies, and
`fxshard::embedding_accumulate` becomes `fxshard::embedding_accumulate_`, the rows added where it
lies, where the total is a temporary of the step that nothing else reads (fresh memory: a cast of the first microbatch's
gradient, or an earlier accumulation's result). Its functional form has to copy the total first
(aten's addmm writes C in place), a full pass per accumulation. Each in-place node then moves down
to the end of its layer's run of compute nodes (no further than the first node that reads the total,
is fixed, or belongs to another layer, microbatch or pipeline action), so that codegen's region of
that layer is cut once at its end rather than at every weight gradient.
Invariant: as above; a node is rewritten only when its total is such a temporary read by it alone.

`gather_updates_in_place` does the same for ZeRO-1/2's all-gather of each updated shard: the gather
writes into the flat parameter it updates (`all_gather_into_tensor_out`) instead of a new tensor that
CUDA graph replay then copies back (2x H200, MoE ep=2 with ZeRO-1 over the dense layers: six copies,
0.39 ms at the end of every step with no compute beside them; bench/RESULTS.md 2026-11-28, session 29).
Invariant: as above; a gather is rewritten only when its result is the new value of a flat parameter
input of the same shape and dtype and nothing else (no metric) returns it, nothing reads that input or
anything that may alias it after the gather is issued, no collective, gather or send reads it at all
(those read on another stream until their wait), and the gathered shard cannot alias it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import meta
from ..codegen import is_fixed
from ..graph import Graph, is_view, may_alias_input, lazy_module
from ..meta import COLLECTIVE_ISSUES
from ..ops.adamw import adamw_update, adamw_update_  # noqa: F401  (registers both ops)
from ..ops.embedding_accumulate import embedding_accumulate, embedding_accumulate_  # noqa: F401  (registers both)
from ..ops.matmul_accumulate import matmul_accumulate, matmul_accumulate_  # noqa: F401  (registers both)
from ..ops.gloo import GLOO_ALL_GATHER, gloo_all_gather_into_tensor_out
from ..ops.p2p import P2P_OPS
from ..program import InputKind, OutputKind, Program

_FUNCTIONAL = torch.ops.fxshard.adamw_update.default
_IN_PLACE = torch.ops.fxshard.adamw_update_.default
# an accumulation into a total -> the same written into the total
_IN_PLACE_ACCUMULATION = {torch.ops.fxshard.matmul_accumulate.default: torch.ops.fxshard.matmul_accumulate_.default,
                          torch.ops.fxshard.embedding_accumulate.default:
                          torch.ops.fxshard.embedding_accumulate_.default}
_MUTATED = {0: "param", 2: "exp_avg", 3: "exp_avg_sq"}  # argument position -> name; outputs 0, 1, 2
_c10d = torch.ops._c10d_functional
# the state a step's outputs become (its inputs next step): output kind -> input kind
WRITE_BACK = {OutputKind.PARAM: InputKind.PARAM, OutputKind.OPT_STATE: InputKind.OPT_STATE,
              OutputKind.BUFFER: InputKind.BUFFER, OutputKind.LOSS_SCALE: InputKind.LOSS_SCALE}
# an all-gather -> the same gather into a given tensor (`out=`), returning it
_INTO = {_c10d.all_gather_into_tensor.default: _c10d.all_gather_into_tensor_out.default,
         GLOO_ALL_GATHER: gloo_all_gather_into_tensor_out}
_GATHERS = frozenset({*_INTO, *_INTO.values()})


def reinplace(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` with every safe AdamW update done in place; and how many were."""
    graph = Graph()
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
    return lazy_module(graph_module, graph), rewritten


def accumulate_in_place(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` with every safe `fxshard::matmul_accumulate` and
    `fxshard::embedding_accumulate` done in place (see the module docstring); and how many were. Checked on the graph as given: a total read by its
    accumulation alone is read by nothing else once that accumulation writes it instead."""
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    found = [node for node in graph.nodes if node.op == "call_function" and node.target in _IN_PLACE_ACCUMULATION
             and not node.kwargs and _fresh(node.args[0], node)]
    for node in found:
        total = node.args[0]
        with graph.inserting_before(node):
            in_place = graph.call_function(_IN_PLACE_ACCUMULATION[node.target], node.args)
        in_place.meta.update({key: value for key, value in node.meta.items() if key != "val"})
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        _move_to_run_end(in_place, total)
    graph.lint()
    return lazy_module(graph_module, graph), len(found)


def _fresh(total, node: fx.Node) -> bool:
    """`total` is memory of the step's own that `node` alone reads (`_temporary`), made by compute:
    not a collective's or a transfer's result, which lives in a buffer its lowering owns."""
    if not _temporary(total, node):
        return False
    while is_view(total):
        total = total.args[0]
    return not (getattr(total.target, "namespace", None) in ("_c10d_functional", "c10d") or total.target in P2P_OPS)


def _move_to_run_end(node: fx.Node, total: fx.Node) -> None:
    """Move `node` down past the compute nodes after it of the same (phase, microbatch, layer, action)
    that do not read `total`: to the end of its layer's run, where codegen's region ends anyway."""
    part = _part(node)
    after = node.next
    while after.op == "call_function" and not is_fixed(after) and _part(after) == part \
            and total not in after.all_input_nodes:
        after = after.next
    if after is not node.next:
        after.prepend(node)


def _part(node: fx.Node) -> tuple:
    return meta.phase(node), meta.microbatch(node), meta.layer(node), meta.action_index(node)


def write_back_positions(program: Program) -> dict[int, int]:
    """Output position -> the position of the input it becomes for the next step (parameters, optimizer
    state, buffers: the state the step owns)."""
    inputs = {(spec.kind, spec.name): position for position, spec in enumerate(program.inputs)}
    return {position: inputs[WRITE_BACK[spec.kind], spec.name] for position, spec in enumerate(program.outputs)
            if spec.kind in WRITE_BACK and (WRITE_BACK[spec.kind], spec.name) in inputs}


def gather_updates_in_place(graph_module: fx.GraphModule, write_back: dict[int, int]) -> tuple[fx.GraphModule, int]:
    """`graph_module` with every safe gather of an updated parameter writing into that parameter's
    input, and how many were rewritten. `write_back`: output position -> the position of the input
    (placeholder) that output becomes next step (the runtime's write-back, CompiledStep)."""
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    order = {node: position for position, node in enumerate(graph.nodes)}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    output = next(node for node in graph.nodes if node.op == "output")
    rewritten = 0
    values = list(output.args[0])
    for position, value in enumerate(values):
        if position not in write_back or not isinstance(value, fx.Node) or values.count(value) != 1:
            continue
        target = placeholders[write_back[position]]
        gather = value.args[0] if value.target is _c10d.wait_tensor.default else None
        if gather is None or gather.target not in _INTO or list(gather.users) != [value] \
                or list(value.users) != [output]:  # a metric returning it too would alias the state
            continue
        if not _same_layout(gather, target) or _read_later(target, gather, order) \
                or _aliases(gather.args[0], target):
            continue
        with graph.inserting_before(gather):
            into = graph.call_function(_INTO[gather.target], gather.args, {"out": target})
        into.meta.update(gather.meta)
        order[into] = order[gather]
        gather.replace_all_uses_with(into)
        graph.erase_node(gather)
        rewritten += 1
    graph.lint()
    return lazy_module(graph_module, graph), rewritten


def _same_layout(gather: fx.Node, target: fx.Node) -> bool:
    new, old = gather.meta.get("val"), target.meta.get("val")
    return isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new.shape == old.shape \
        and new.dtype == old.dtype


def _read_later(value: fx.Node, gather: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Something reads `value`, or anything that may alias it (`may_alias_input`: views, getitems, waits,
    ops without a schema), after `gather` in graph order (the output included), or a
    collective, a gather or a send reads it at all (on another stream, until its wait)."""
    pending, seen = [value], {value}
    while pending:
        for user in pending.pop().users:
            if user is gather:
                continue
            if user.op == "call_function" and (user.target in COLLECTIVE_ISSUES or user.target in P2P_OPS
                                               or user.target in _GATHERS):
                return True
            if order[user] > order[gather]:
                return True
            if user not in seen and may_alias_input(user):
                seen.add(user)
                pending.append(user)
    return False


def _aliases(value, base: fx.Node) -> bool:
    """`value` may be `base` or share its memory: `base` is reached through nodes that may alias an input."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if node is base:
            return True
        if not isinstance(node, fx.Node) or node in seen or node.op != "call_function" or not may_alias_input(node):
            continue
        seen.add(node)
        pending.extend(arg for arg in node.all_input_nodes)
    return False


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
