"""Lowering for execution: expert weight gradients on a side stream, next to the rest of the backward.

The fused grouped MLP's backward is two graph nodes, `grouped_mlp_dgrad` and `grouped_mlp_wgrad`
(and the unfused experts' `grouped_mm_wgrad`), so that the weight gradient can be scheduled apart
from the data gradient the backward's critical path waits on (Megatron's delay_wgrad_compute). This
lowering does it with streams: each expert weight-gradient node runs on a side stream, forked from
the compute stream where the node stood, and the compute stream waits for it only just before the
first node that reads one of its results (the gradient's reduction, accumulation or the optimizer).
Meanwhile the compute stream goes on with the backward of the layers below: the weight-gradient
GEMMs (compute-bound, two thirds of an expert backward's FLOPs) share the GPU with dispatch
gathers, attention backward and elementwise kernels, and fill the tail waves of the data-gradient
GEMMs. Under CUDA graphs the fork and join are captured as graph dependencies.

Memory: a side-stream node's inputs are recorded on the side stream (Tensor.record_stream), so the
allocator hands their blocks out again only once the side stream is done with them; results are
allocated on the side stream and read on the compute stream after the join. Every side-stream node
forks anew (the side stream first waits for the compute stream), so a block the compute stream
freed is reused on the side stream only after the compute stream's earlier work.

Invariant: the lowered graph computes the same values as its input (the same ops on the same
inputs, bit for bit; only the stream they run on and when the compute stream waits change).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    index = torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def _on_cuda(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


def _on_side_stream(op, args):
    if not _on_cuda(args):  # nothing to overlap with (CPU): the op itself
        return op(*args)
    side, main = _side_stream(), torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = op(*args)
    for value in args:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(side)
    return result


def grouped_mlp_wgrad_on_side_stream(*args):
    """torch.ops.fxshard.grouped_mlp_wgrad, enqueued on the side stream (read it after join_side_stream)."""
    return _on_side_stream(torch.ops.fxshard.grouped_mlp_wgrad.default, args)


def grouped_mm_wgrad_on_side_stream(*args):
    """torch.ops.fxshard.grouped_mm_wgrad, enqueued on the side stream (read it after join_side_stream)."""
    return _on_side_stream(torch.ops.fxshard.grouped_mm_wgrad.default, args)


def join_side_stream(value):
    """`value` (a side-stream node's result), once the compute stream has waited for the side stream."""
    if _on_cuda(value if isinstance(value, (tuple, list)) else (value,)):
        torch.cuda.current_stream().wait_stream(_side_stream())
    return value


_LOWERED = {"grouped_mlp_wgrad": grouped_mlp_wgrad_on_side_stream,
            "grouped_mm_wgrad": grouped_mm_wgrad_on_side_stream}


def weight_grads_on_side_stream(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` whose expert weight-gradient nodes run on a side stream, each joined
    just before the first node reading its results; and how many were lowered."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    order = {node: i for i, node in enumerate(graph.nodes)}
    lowered = 0
    for node in list(graph.nodes):
        name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
        if getattr(node.target, "namespace", None) != "fxshard" or name not in _LOWERED:
            continue
        node.target = _LOWERED[name]
        # the values that carry its results: the node itself, or the getitems of a tuple result
        items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        carriers = items if items and len(items) == len(node.users) else [node]
        readers = [r for c in carriers for r in c.users] if carriers != [node] else list(node.users)
        if not readers:
            continue
        first = min(readers, key=order.get)
        with graph.inserting_before(first):
            joined = graph.call_function(join_side_stream, (node,))
        joined.meta.update({k: v for k, v in node.meta.items() if k == "val"})
        for carrier in (items if carriers != [node] else []):
            carrier.args = (joined, *carrier.args[1:])
            first.prepend(carrier)  # after the join, before its first reader
        if carriers == [node]:
            for reader in readers:
                reader.replace_input_with(node, joined)
        lowered += 1
    graph.lint()
    return fx.GraphModule(graph_module, graph), lowered
