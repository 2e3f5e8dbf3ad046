"""recompute: what the backward reads from inside an activation-checkpointed call is computed again.

`torch.utils.checkpoint.checkpoint(fn, *args)` (transformers' `gradient_checkpointing_enable()`
calls it per decoder layer) asks autograd to keep only the call's inputs and to run `fn` again when
the backward needs a value made inside it. A joint trace computes every forward value once and lets
the backward read it, which would keep all of them: the checkpoint silently lost. The tracer marks
each node made inside a checkpointed call (meta.RECOMPUTE: the call's number; fxshard/trace.py
`_checkpoints_marked`), and this pass gives the backward of each call and microbatch its own copy of
the call's inner forward nodes it reads (not the call's results, which later forward code reads:
those stay alive as the next call's saved input would), and of those they are computed from inside the call, placed right
before the first backward node that reads any of them. The forward's originals then die where the
forward stops needing them, and the copies live from the backward's first read to its last.

What is computed again: deterministic ops (`graph.is_pure`: aten, no mutation, no random draw; an
attention call with dropout_p == 0 too; not the scatters that accumulate with atomics on CUDA, such
as index_add, whose sums could come out in another order). A call that runs several layers is taken
layer by layer (a pipeline may cut between them): a layer's values that the next one reads count as
results. A value made by anything else inside the call (a random
draw such as dropout, which must not be drawn again; a collective; a custom op such as the fused
grouped MLP) is read where the forward made it, as is every value the call read from outside,
and every value the call's selective checkpointing policy saves (checkpoint's `context_fn` from
`create_selective_checkpoint_contexts`, asked by the tracer: meta.SAVED), so a copy stops there.

Invariant: the program computes the same values (each copy runs its original's op on the same
inputs, so on one device bit-identically), and no backward node reads a recomputable forward value
made inside a checkpointed call that only the call itself reads in the forward; the bytes of forward values the backward reads never grow.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.graph import Graph, draws_random, is_pure, lazy_module
from fxshard.program import Program

_ATTENTION = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._flash_attention_forward.default,  # passes/flash_attention.py's
})


# pure, but accumulating with atomics on CUDA: computed again, the sum could differ in its last bits
_ATOMIC = frozenset({
    torch.ops.aten.index_add.default, torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_reduce.two,
    torch.ops.aten.index_put.default, torch.ops.aten._index_put_impl.default,
})


def recomputable(node: fx.Node) -> bool:
    """Computing `node` again gives the same bits: a pure op that accumulates without atomics, or
    attention that draws no dropout."""
    if is_pure(node):
        return node.target not in _ATOMIC
    return node.op == "call_function" and node.target in _ATTENTION and not draws_random(node)


def internal(node: fx.Node, call: set[fx.Node]) -> bool:
    """No forward node outside the call reads `node`: it is not one of the call's results (a result
    stays alive anyway: the next layer reads it, and a checkpoint keeps its own inputs)."""
    return all(u in call or meta.phase(u) != meta.FWD for u in node.users)


def checkpointed_calls(graph: fx.Graph) -> dict[tuple, list[fx.Node]]:
    """(call number, microbatch, layer) -> the forward nodes made inside that checkpointed call, in
    graph order. Per layer too: a call over several layers (checkpoint_sequential) may span pipeline
    chunks, and a chunk's backward must only read copies its own backward made."""
    calls: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.meta.get(meta.RECOMPUTE) is not None and meta.phase(node) == meta.FWD:
            calls.setdefault((node.meta[meta.RECOMPUTE], meta.microbatch(node), meta.layer(node)), []).append(node)
    return calls


def recompute(program: Program) -> Program:
    """`program` with the backward reading copies of checkpointed calls' forward values (see the
    module docstring); the same program when no call was checkpointed."""
    graph = program.graph
    calls = checkpointed_calls(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    before: dict[fx.Node, list[fx.Node]] = {}  # the first backward reader -> the nodes to copy there
    read_count = recomputed_calls = 0
    for nodes in calls.values():
        members = set(nodes)
        inside = {n for n in nodes if recomputable(n) and not n.meta.get(meta.SAVED)}
        read = [n for n in inside if internal(n, members) and any(meta.phase(u) == meta.BWD for u in n.users)]
        if not read:
            continue
        read_count, recomputed_calls = read_count + len(read), recomputed_calls + 1
        plan_copies(before, read, inside, position)
    if not before:
        return program

    new = with_copies(graph, before)
    new.lint()
    copied_count = sum(len(nodes) for nodes in before.values())
    kept = sum(1 for nodes in calls.values() for n in nodes if n.meta.get(meta.SAVED))
    notes = dict(program.notes, recompute=f"{recomputed_calls} checkpointed calls: {copied_count} forward nodes computed "
                                          f"again in the backward, where it read {read_count} of their values"
                                          + (f"; {kept} values kept by selective policies" if kept else ""))
    return program.replace(graph_module=lazy_module(program.graph_module, new), notes=notes)


def plan_copies(before: dict[fx.Node, list[fx.Node]], read: list[fx.Node], within: set[fx.Node],
                position: dict[fx.Node, int]) -> None:
    """Add to `before` (the first backward reader -> the forward nodes to copy there) the forward values
    `read` and what they are computed from within `within`, in graph order, before the first backward
    node that reads one of them."""
    copied, stack = set(), list(read)
    while stack:
        node = stack.pop()
        if node not in copied:
            copied.add(node)
            stack.extend(n for n in node.all_input_nodes if n in within)
    first = min((u for n in read for u in n.users if meta.phase(u) == meta.BWD), key=position.__getitem__)
    before.setdefault(first, []).extend(sorted(copied, key=position.__getitem__))


def with_copies(graph: fx.Graph, before: dict[fx.Node, list[fx.Node]]) -> Graph:
    """A copy of `graph` in which, right before each node of `before`, copies of that node's list of
    forward nodes are made (in the list's order: each reads the copies made before it, else the
    originals), as backward nodes named recompute_<the forward node>, and every backward node reads
    the copies in place of their originals."""
    new = Graph()
    env: dict[fx.Node, fx.Node] = {}
    copies: dict[fx.Node, fx.Node] = {}  # a forward original -> its copy for the backward

    def copied_or_kept(n: fx.Node) -> fx.Node:
        return copies[n] if n in copies else env[n]

    for node in graph.nodes:
        for original in before.get(node, ()):  # named for the dumps: recompute_<the forward node>
            args, kwargs = fx.map_arg((original.args, original.kwargs), copied_or_kept)
            copy = new.create_node(original.op, original.target, args, kwargs, name=f"recompute_{original.name}")
            copy.meta = {k: v for k, v in original.meta.items() if k != meta.RECOMPUTE}
            copy.meta[meta.PHASE] = meta.BWD
            copies[original] = copy
        env[node] = new.node_copy(node, copied_or_kept if meta.phase(node) == meta.BWD else env.__getitem__)
    return new
