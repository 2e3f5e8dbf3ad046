"""recompute_pointwise: what the backward reads and cheap ops make is computed again in the backward.

A joint trace lets the backward read every forward value that autograd saves. Much of that is made
by pointwise ops from other values: an RMSNorm in fp32 (Llama's, Gemma's) saves its input cast to
fp32 and the normalized product, two fp32 copies of a bf16 hidden state per norm; an MLP saves its
activation's output next to its input. torch.compile's partitioner saves less: it chooses the
values to keep by a minimum cut and computes the rest again in the backward, inside the kernels that
read them. This pass does the same for the whole step. On transformers' Gemma 3 (6 layers of 4B's
shape, 4096 tokens) it takes what the backward reads from 7.9 to 3.5 GiB, the peak on an H200 from
16.9 to 13.6 GiB.

Which forward nodes may be computed again: pointwise aten ops, views and casts (`_to_copy`,
`clone`) that give the same bits again (passes/recompute.py `recomputable`), made from the batch (a
value of the weights alone, such as a weight's bf16 copy, stays computed once), not kept by a
selective checkpointing policy (meta.SAVED), and read only by nodes of their own layer and
microbatch (forward or backward; so a copy runs inside the backward of that layer, and a pipeline
cut between layers leaves each chunk's copies reading values of its own chunk).

The cut: each forward node n is an edge n_in -> n_out whose capacity is the bytes keeping its value
alive costs (its storage's; nothing for an input or output of the step or a value the optimizer
reads, which are alive anyway); the source feeds n_in of every node that may not be computed again,
each forward edge a -> b is a_out -> b_in, and n_out feeds the sink where a backward node reads n.
A minimum cut splits the nodes into those the forward computes (the source's side) and those the
backward computes again (the sink's side); the cut's edges are the values kept for the backward. Each backward node reading a value of
the sink's side reads a copy instead: the value's op run again on copies or kept values, each copy
made right before the first backward node that reads it or a copy made from it (so a value lives
in the backward only from there, however the model names its layers), and made once. Forward
nodes nothing reads any more are dropped.

Invariant: the program computes the same values (each copy runs its original's op on the same
inputs: on one device the same bits; compiled, Inductor may fuse a copy otherwise and round
differently), and the bytes of forward values the backward reads do not grow (the cut is minimal,
and what the backward read before is one cut; each value costed by its storage).
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from fxshard import meta
from fxshard.dump import format_bytes
from fxshard.graph import is_pure, lazy_module
from fxshard.program import InputKind, Program
from fxshard.passes.recompute import recomputable, with_copies

aten = torch.ops.aten
CASTS = frozenset({aten._to_copy.default, aten.clone.default})


def recompute_pointwise(program: Program) -> Program:
    """`program` with the backward computing again what the minimum cut leaves out (module docstring);
    the same program where the cut keeps what the backward reads."""
    graph = program.graph
    forward = [n for n in graph.nodes if meta.phase(n) == meta.FWD or n.op in ("placeholder", "get_attr")]
    again = _sink_side(forward, _cheap(program))
    read = [n for n in again if any(meta.phase(u) == meta.BWD for u in n.users)]
    if not read:
        return program
    before_bytes = _read_bytes(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    first_reader = {n: min((u for u in n.users if meta.phase(u) == meta.BWD), key=position.__getitem__)
                    for n in read}
    before: dict[fx.Node, list[fx.Node]] = {}  # a backward node -> the nodes to copy right before it
    planned: set[fx.Node] = set()
    for node in sorted(read, key=lambda n: position[first_reader[n]]):  # each just before its first reader
        chain, stack = set(), [node]
        while stack:  # what it is computed from on the sink's side, less what earlier copies made
            member = stack.pop()
            if member not in chain and member not in planned:
                chain.add(member)
                stack.extend(n for n in member.all_input_nodes if n in again)
        before.setdefault(first_reader[node], []).extend(sorted(chain, key=position.__getitem__))
        planned |= chain

    new = with_copies(graph, before)
    for node in reversed(list(new.nodes)):  # forward originals only the backward read
        if not node.users and meta.phase(node) == meta.FWD and is_pure(node):
            new.erase_node(node)
    new.lint()
    after_bytes = _read_bytes(new)
    copied_count = sum(len(nodes) for nodes in before.values())
    notes = dict(program.notes, recompute_pointwise=(
        f"the backward reads {format_bytes(after_bytes)} of forward values instead of {format_bytes(before_bytes)}: "
        f"{copied_count} pointwise, view and cast nodes computed again in the backward ({len(read)} of them read "
        f"there)"))
    return program.replace(graph_module=lazy_module(program.graph_module, new), notes=notes)


def runs_on(program: Program, config) -> bool:
    """Whether Config(recompute_pointwise) asks for the pass on `program`: True / False, or None (the
    default) where the step's compute is compiled on the device the program runs on (Config(codegen))."""
    if config.recompute_pointwise is not None:
        return config.recompute_pointwise
    devices = [n.meta["val"].device for n, spec in zip(program.placeholders(), program.inputs)
               if spec.kind is InputKind.BATCH and isinstance(n.meta.get("val"), torch.Tensor)]
    return config.compiles_on(devices[0] if devices else torch.device("cpu"))  # the batch's, as shard's codegen


def _cheap(program: Program):
    """node -> whether it may be computed again (module docstring)."""
    graph = program.graph
    batch = {node for node, spec in zip(program.placeholders(), program.inputs) if spec.kind is InputKind.BATCH}
    from_batch: set[fx.Node] = set()
    for node in graph.nodes:
        if node in batch or any(n in from_batch for n in node.all_input_nodes):
            from_batch.add(node)

    def cheap(node: fx.Node) -> bool:
        if (node.op != "call_function" or node not in from_batch or not recomputable(node)
                or node.meta.get(meta.SAVED) or not isinstance(node.meta.get("val"), torch.Tensor)):
            return False
        target = node.target
        if not (target in CASTS or torch.Tag.pointwise in getattr(target, "tags", ()) or _is_view_op(node)):
            return False
        own = (meta.layer(node), meta.microbatch(node))
        return all((meta.layer(u), meta.microbatch(u)) == own and meta.phase(u) in (meta.FWD, meta.BWD)
                   for u in node.users)
    return cheap


def _is_view_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and (node.target is aten._unsafe_view.default
                                   or any(r.alias_info is not None for r in schema.returns))


def _sink_side(forward: list[fx.Node], cheap) -> set[fx.Node]:
    """The forward nodes a minimum cut puts on the sink's side: computed again for the backward.

    Only the nodes that may be computed again and their inputs enter the flow graph: any other node
    hangs from the source, so its n_in is on the source's side in every cut, an edge into it is never
    cut, and the cost of keeping it, where nothing cheap reads it, is the same in every cut."""
    again = [node for node in forward if cheap(node)]
    cut = nx.DiGraph()
    for node in dict.fromkeys(n for node in again for n in (*node.all_input_nodes, node)):
        inside, outside = ("in", node), ("out", node)
        alive_anyway = node.op in ("placeholder", "get_attr") or any(
            meta.phase(u) not in (meta.FWD, meta.BWD) for u in node.users)  # an input, an output, the optimizer's
        cut.add_edge(inside, outside, capacity=0 if alive_anyway else _storage_bytes(node.meta.get("val")))
        if any(meta.phase(u) == meta.BWD for u in node.users):
            cut.add_edge(outside, "sink")
        if meta.phase(node) != meta.FWD or not cheap(node):
            cut.add_edge("source", inside)  # no capacity: unbounded
            continue
        for source in node.all_input_nodes:
            cut.add_edge(("out", source), inside)
    if "sink" not in cut:
        return set()
    _, (_, sink_side) = nx.minimum_cut(cut, "source", "sink")
    return {node for node in again if ("in", node) in sink_side}


def _storage_bytes(value) -> int:
    """Bytes keeping `value` alive costs: its storage's (a view keeps its base), every tensor of a tuple."""
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_storage_bytes(v) for v in value)
    return 0


def _read_bytes(graph: fx.Graph) -> int:
    """Bytes of the forward values the backward reads, each costed by its storage, as the cut costs
    them (fxshard.dump.saved_activation_bytes counts elements: an expanded view is larger there)."""
    return sum(_storage_bytes(n.meta.get("val")) for n in graph.nodes
               if meta.phase(n) == meta.FWD and n.op not in ("placeholder", "get_attr")
               and any(meta.phase(u) == meta.BWD for u in n.users))
