"""Stage split: cut a traced Program at layer boundaries into pipeline chunks.

The input is the program of one microbatch. Its layers (`pre`, the model's blocks, `post`) are
dealt into `chunks` contiguous groups — balanced by their FLOPs (`layer_costs`: the costliest chunk
as cheap as it can be), or as `stage_layers` says — with `pre` (embedding) in the first chunk and
`post` (head and loss) in the last. Every forward and
backward node belongs to its layer's chunk; the optimizer phase is left out (the runtime updates
each rank's parameters after all microbatches).

Each `Chunk` has two graphs with explicit boundaries:

    forward   (params[, scale], batch leaves, received activations) -> (sent activations, saved values[, loss])
    backward  (params[, scale], batch leaves, saved values, received gradients) -> (sent gradients, parameter gradients)

(`scale`: a dynamic loss scale's state, which the backward of the chunk computing the loss multiplies
its loss tangent by; `Chunk.loss_scale` says whether a chunk takes it.)

`sent` of chunk c is every forward value made in chunks <= c that a later chunk reads (an activation
a later chunk needs passes through the chunks between: point-to-point only ever goes c -> c+1); the
backward's sent gradients likewise flow c -> c-1. A parameter read by several chunks (tied
embedding and head) gets a partial gradient from each; the runtime sums them before the update. Its
cast to `param_dtype`, like compute that reads no input (RoPE's tables), is made by each chunk that
reads it, never sent.

Metrics a loss_fn reports next to the loss ((loss, {name: value})) are outputs of the forward of
the chunk that computes them, after the loss; the runtime sums them over microbatches and stages.

Invariant: running the chunks' forwards in order and then their backwards in reverse order, passing
each chunk's sent values to its neighbour, gives the loss and the parameter gradients (partials
summed) of the input program's forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.balance import DATA_SUM
from fxshard.errors import FxShardError
from fxshard.graph import Graph, ancestors, flops, is_pure, lazy_module
from fxshard.program import InputKind, OutputKind, Program

_ADD = torch.ops.aten.add.Tensor
_CAST = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class Chunk:
    index: int
    layers: tuple[str, ...]
    forward: fx.GraphModule
    backward: fx.GraphModule
    params: tuple[str, ...]       # parameters (and read-only buffers) both graphs take first, in this order
    batch: tuple[int, ...]        # indices of the batch leaves both graphs take next
    recv: tuple[str, ...]         # activations received from chunk index-1 (forward inputs, after the batch)
    send: tuple[str, ...]         # activations sent to chunk index+1 (forward outputs, first)
    saved: tuple[str, ...]        # forward outputs after `send`, backward inputs after the batch
    has_loss: bool                # the forward's outputs end with the loss, then `metrics`
    metrics: tuple[str, ...]      # reported metrics this chunk's forward computes (last outputs)
    grad_recv: tuple[str, ...]    # gradients received from chunk index+1 (backward inputs, last)
    grad_send: tuple[str, ...]    # gradients sent to chunk index-1 (backward outputs, first)
    grads: tuple[str, ...]        # parameters whose (partial) gradient follows, in this order
    # The backward split for schedules with W actions (zero bubble): `backward_input` computes the
    # sent gradients and `carry` (values the weight part needs), `backward_weight` the rest.
    backward_input: fx.GraphModule | None = None   # (params[, scale], batch, saved, grad_recv) -> (grad_send, carry)
    backward_weight: fx.GraphModule | None = None  # (params[, scale], batch, saved, grad_recv, carry) -> param grads
    carry: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()  # buffers the forward updates (BatchNorm statistics, routing counts): its last outputs
    loss_scale: bool = False       # both graphs take the dynamic loss scale's state right after `params`

    @property
    def forward_outputs(self) -> tuple[str, ...]:
        """Names of the forward's outputs before the loss: sent values, then saved values not sent."""
        return self.send + tuple(s for s in self.saved if s not in self.send)


@dataclass(frozen=True)
class PipelineProgram:
    chunks: tuple[Chunk, ...]
    source: Program
    layers: tuple[tuple[str, ...], ...]

    def summary(self) -> str:
        lines = []
        for c in self.chunks:
            lines.append(f"chunk {c.index}: layers {', '.join(c.layers)}; {len(c.params)} params; "
                         f"recv {len(c.recv)} send {len(c.send)} saved {len(c.saved)}; "
                         f"grad recv {len(c.grad_recv)} send {len(c.grad_send)}; "
                         f"forward {_count(c.forward)} nodes, backward {_count(c.backward)} nodes")
        return "\n".join(lines)


def _count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def assign_layers(layers: list[str], chunks: int, costs: dict[str, float],
                  stage_layers: list[int] | None = None) -> list[list[str]]:
    """Blocks dealt into `chunks` contiguous groups; `pre` joins the first, `post` the last.

    Default: the cut that makes the costliest chunk cheapest, `pre` and `post` counted in theirs
    (`costs[layer]`, e.g. `layer_costs`: a language model's head is a block's worth of work, its
    embedding next to none). `stage_layers` gives the counts instead."""
    if chunks < 1:
        raise FxShardError(f"a pipeline needs at least one chunk, got {chunks}")
    if chunks > max(len(layers), 1):
        raise FxShardError(f"{chunks} pipeline chunks (stages x virtual stages) but the model has only "
                           f"{len(layers)} layers to cut between; use fewer stages or virtual stages (dualpipev "
                           f"always has 2 per stage: fewer stages), or name more layers with Config(layers=...) "
                           f"(an encoder-decoder model's encoder blocks, or each block's attention and MLP)")
    if stage_layers is not None:
        if len(stage_layers) != chunks or sum(stage_layers) != len(layers) or min(stage_layers) < 1:
            raise FxShardError(f"stage_layers={list(stage_layers)} must give {chunks} positive layer counts "
                               f"summing to the model's {len(layers)} layers")
        counts = list(stage_layers)
    else:
        counts = _balanced([costs.get(layer, 0) for layer in layers], chunks,
                           costs.get(meta.PRE, 0), costs.get(meta.POST, 0))
    groups, start = [], 0
    for count in counts:
        groups.append(layers[start:start + count])
        start += count
    groups[0] = [meta.PRE, *groups[0]]
    groups[-1] = [*groups[-1], meta.POST]
    return groups


def _balanced(weights: list[float], chunks: int, first: float = 0, last: float = 0) -> list[int]:
    """Contiguous counts (each >= 1) minimizing the largest chunk's weight, `first` added to the first
    chunk's and `last` to the last's; among cuts with the same largest chunk, the DP prefers prefixes
    with a smaller sum of squared chunk weights (evener chunks, though not always the evenest cut).
    It looks at chunks, not ranks: with V > 1 chunks per rank, the cut that makes the schedule
    shortest may differ (Config(stage_layers) sets one)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def weight(k: int, j: int, i: int) -> float:  # chunk k (1-based) holding blocks j..i-1
        return prefix[i] - prefix[j] + (first if k == 1 else 0) + (last if k == chunks else 0)

    # best[k][i]: (largest chunk weight, sum of squared chunk weights) splitting blocks[:i] into k chunks
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, chunks + 1):
        for i in range(k, n + 1):
            if k == chunks and i != n:
                continue
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                w = weight(k, j, i)
                value = (max(best[k - 1][j][0], w), best[k - 1][j][1] + w * w)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(chunks, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def layer_costs(program: Program) -> dict[str, float]:
    """What each layer (`pre`, the blocks, `post`) costs to run: the FLOPs of its GEMM-class nodes
    (fxshard.graph.flops) over forward and backward. A program with no such FLOPs falls back to
    parameter bytes, so its cut still follows where the weights are."""
    costs: dict[str, float] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and meta.phase(node) in (meta.FWD, meta.BWD) and (work := flops(node)):
            costs[meta.layer(node)] = costs.get(meta.layer(node), 0) + work
    if costs:
        return costs
    for node, spec in zip(program.placeholders(), program.inputs):
        if spec.kind is InputKind.PARAM:
            value = node.meta["val"]
            costs[meta.layer(node)] = costs.get(meta.layer(node), 0) + value.numel() * value.element_size()
    return costs


def chunk_costs(pipeline: "PipelineProgram", schedule) -> dict[str, float]:
    """The simulator's time of every chunk's actions under `schedule` (fxshard.schedule.simulate's
    `cost`): `F{c}`, and `B{c}` the whole backward or, where the schedule splits W off, its
    input-gradient part with `W{c}` the weight-gradient part; from their GEMM FLOPs, scaled so that
    a stage's forward takes 1 on average, as in `unit_costs`. Empty where the chunks have no FLOPs
    (the simulator's defaults then)."""
    def work(gm: fx.GraphModule) -> float:
        return float(sum(flops(n) for n in gm.graph.nodes if n.op == "call_function"))

    splits_w = any(a.kind == "W" for actions in schedule.ranks for a in actions)
    raw = {}
    for c in pipeline.chunks:
        raw[f"F{c.index}"] = work(c.forward)
        if splits_w:
            raw.update({f"B{c.index}": work(c.backward_input), f"W{c.index}": work(c.backward_weight)})
        else:
            raw[f"B{c.index}"] = work(c.backward)
    forward = sum(raw[f"F{c.index}"] for c in pipeline.chunks)
    if not forward:
        return {}
    return {key: value * schedule.stages / forward for key, value in raw.items()}


def split_stages(program: Program, chunks: int, stage_layers: list[int] | None = None) -> PipelineProgram:
    """Cut `program` (one microbatch, as traced) into `chunks` pipeline chunks. See the module docstring."""
    graph = program.graph
    if any(n.target is DATA_SUM for n in graph.nodes):
        raise FxShardError("split_stages takes the program of one microbatch without torchtitan's load-balancing "
                           "update, which each stage adds after its last forward: trace it with "
                           "fxshard.trace(..., balance=False)")
    if any(meta.microbatch(n) for n in graph.nodes):
        raise FxShardError("split_stages takes the program of one microbatch; the pipeline runtime "
                           "feeds microbatches itself (leave Config(microbatches) to the schedule)")
    layers = [layer for layer in program.notes.get("layers", [])]
    groups = assign_layers(layers, chunks, layer_costs(program), stage_layers)
    chunk_of_layer = {layer: c for c, group in enumerate(groups) for layer in group}
    return _Splitter(program, groups, chunk_of_layer).run()


class _Splitter:
    def __init__(self, program: Program, groups, chunk_of_layer):
        self.program, self.groups, self.chunk_of_layer = program, groups, chunk_of_layer
        self.graph = program.graph
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.specs = dict(zip(program.placeholders(), program.inputs))

    def chunk(self, node: fx.Node) -> int:
        if node in self.moved:
            return self.moved[node]
        layer = meta.layer(node)
        if layer not in self.chunk_of_layer:
            raise FxShardError(f"node {node.name} belongs to layer {layer!r}, which no pipeline chunk holds")
        return self.chunk_of_layer[layer]

    def run(self) -> PipelineProgram:
        count = len(self.groups)
        self.moved: dict[fx.Node, int] = {}
        self.input_free = self.find_input_free()
        self.input_free |= self.casts_read_by_several_chunks()
        self.move_gradient_sums()
        self.gradient_parts = self.find_gradient_parts()
        combine = {n for parts in self.gradient_parts.values() for n in parts["tree"]}
        self.metric_nodes = {node: spec.name for spec, node in zip(self.program.outputs, self.program.output_nodes())
                             if spec.kind is OutputKind.METRIC}
        fwd = [[] for _ in range(count)]
        bwd = [[] for _ in range(count)]
        for node in self.graph.nodes:
            # input-free compute is copied into each chunk that reads it; a metric that is input-free
            # (a constant count) is computed by its layer's chunk, or no chunk would report it
            if node.op != "call_function" or node in combine or (
                    node in self.input_free and node not in self.metric_nodes):
                continue
            phase = meta.phase(node)
            if phase == meta.FWD:
                fwd[self.chunk(node)].append(node)
            elif phase == meta.BWD:
                bwd[self.chunk(node)].append(node)
        where = {n: ("fwd", c) for c, nodes in enumerate(fwd) for n in nodes}
        where.update({n: ("bwd", c) for c, nodes in enumerate(bwd) for n in nodes})
        loss = self.program.output_nodes()[0]
        self.buffer_nodes = {node: spec.name for spec, node in zip(self.program.outputs, self.program.output_nodes())
                             if spec.kind is OutputKind.BUFFER}
        for node, name in self.metric_nodes.items():
            if node not in where or where[node][0] != "fwd":  # a stage reports 0 for a metric no chunk makes
                raise FxShardError(f"metric {name!r} is {node.name} ({node.op}), which no pipeline chunk computes "
                                   f"in its forward: return a metric computed in loss_fn (e.g. `b['n'].sum()`, "
                                   f"not the batch's tensor itself)")
        for node, name in self.buffer_nodes.items():
            if node not in where or where[node][0] != "fwd":
                raise FxShardError(f"buffer {name!r} is updated outside the forward of a layer (by {node.name}); "
                                   f"pipeline stages update buffers only in their forward")
        # forward values a later chunk reads (its forward or its backward); backward values an earlier chunk reads
        last_reader: dict[fx.Node, int] = {}
        first_reader: dict[fx.Node, int] = {}
        for node, (phase, c) in where.items():
            for source in node.all_input_nodes:
                if source not in where:
                    continue
                source_phase, source_chunk = where[source]
                if source_phase == "fwd" and c > source_chunk:
                    last_reader[source] = max(last_reader.get(source, c), c)
                elif source_phase == "fwd" and c < source_chunk:
                    raise FxShardError(f"{node.name} (chunk {c}) reads {source.name} made by the forward of a "
                                       f"later chunk {source_chunk}: layers do not run in pipeline order")
                elif source_phase == "bwd" and phase == "bwd" and c < source_chunk:
                    first_reader[source] = min(first_reader.get(source, c), c)
                elif source_phase == "bwd" and c > source_chunk:
                    raise FxShardError(f"{node.name} (chunk {c}) reads the gradient {source.name} of an "
                                       f"earlier chunk {source_chunk}: the backward does not run in reverse order")
        sends = [[n for n in self.graph.nodes if n in last_reader and where[n][1] <= c < last_reader[n]]
                 for c in range(count)]
        grad_sends = [[n for n in self.graph.nodes if n in first_reader and first_reader[n] < c <= where[n][1]]
                      for c in range(count)]
        result = []
        for c in range(count):
            result.append(self.build_chunk(c, fwd[c], bwd[c], sends, grad_sends, loss))
        for chunk in result:  # a buffer carries over between microbatches only within the chunk updating it
            for other in result:
                shared = [b for b in chunk.buffers if other is not chunk and b in other.params]
                if shared:
                    raise FxShardError(
                        f"buffer {shared[0]!r} is updated in the forward of layers {list(chunk.layers)} and read by "
                        f"layers {list(other.layers)}, which fall into another pipeline chunk: the chunks would see "
                        f"different values. Put those layers into one stage (Config(stage_layers=...)), or keep the "
                        f"buffer in the layer that updates it")
        return PipelineProgram(tuple(result), self.program, tuple(tuple(g) for g in self.groups))

    def find_input_free(self) -> set[fx.Node]:
        """Forward compute that reads no input of the step (RoPE's cos/sin tables from `arange`):
        every chunk that reads it computes it itself, like a constant, instead of receiving it with
        each microbatch."""
        free: set[fx.Node] = set()
        for node in self.graph.nodes:
            if (meta.phase(node) == meta.FWD and is_pure(node)
                    and all(i.op == "get_attr" or i in free for i in node.all_input_nodes)):
                free.add(node)
        return free

    def casts_read_by_several_chunks(self) -> set[fx.Node]:
        """A parameter's cast to the compute dtype (Config(param_dtype)) that chunks other than its own
        read (a tied embedding and head): each reading chunk casts the parameter itself, as the copied
        input-free compute does, instead of receiving the cast weight with every microbatch (and
        producing a partial gradient of a parameter it would not hold)."""
        shared = set()
        for node in self.graph.nodes:
            if (node.op == "call_function" and node.target is _CAST and meta.phase(node) == meta.FWD
                    and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
                    and self.specs[node.args[0]].kind is InputKind.PARAM):
                readers = {self.chunk(user) for user in node.users if user.op == "call_function"}
                if len(readers | {self.chunk(node)}) > 1:
                    shared.add(node)
        return shared

    def move_gradient_sums(self) -> None:
        """A backward node that only combines values of one later chunk's backward (the terms of an
        activation's gradient, which autograd may attribute to the layer below) joins that chunk, so
        the chunk sends their sum instead of each term."""
        for node in self.graph.nodes:
            if node.op != "call_function" or meta.phase(node) != meta.BWD or meta.param(node):
                continue
            sources = [i for i in node.all_input_nodes if i.op == "call_function"]
            if len(sources) < 2 or any(meta.phase(i) != meta.BWD for i in sources):
                continue  # only combining nodes move: a node of one source moved would send as much
            chunks = {self.chunk(i) for i in sources}
            if len(chunks) == 1 and (later := chunks.pop()) > self.chunk(node):
                self.moved[node] = later

    def find_gradient_parts(self):
        """Parameter name -> {"parts": {chunk: [contributing nodes]}, "tree": nodes that only sum them,
        "cast": dtype to cast each partial to, or None}."""
        parts = {}
        for node in self.graph.nodes:
            if meta.phase(node) != meta.OPTIM:
                continue
            for source in node.all_input_nodes:
                if meta.phase(source) == meta.BWD and meta.param(source) and meta.param(source) not in parts:
                    parts[meta.param(source)] = self.decompose(source)
        return parts

    def decompose(self, grad: fx.Node):
        cast, top = None, grad
        if grad.target is _CAST:  # the reduce-dtype cast: split what it casts, cast each part
            cast, top = grad.kwargs.get("dtype"), grad.args[0]
        tree, leaves = [], []

        def summing(node, is_top):  # an add only the gradient's sum reads, of two computed values
            return node.target is _ADD and not node.kwargs and (is_top or len(node.users) == 1) and \
                all(isinstance(a, fx.Node) and a.op == "call_function" for a in node.args[:2])

        def chunks(node, is_top):  # the chunks of the partial gradients this sum adds up
            if not summing(node, is_top):
                return {self.chunk(node)} if node.op == "call_function" else set()
            return chunks(node.args[0], False) | chunks(node.args[1], False)

        def walk(node, is_top):
            # taken apart where its parts lie in several chunks, to any depth: a weight read in
            # several places of one chunk (T5's shared embedding: encoder, decoder) and tied to
            # another's (the head) sums add(add(head, decoder), encoder), whose top add's two
            # inputs lie in the same chunk
            if summing(node, is_top) and len(chunks(node, is_top)) > 1:
                tree.append(node)
                for a in node.args[:2]:
                    walk(a, False)
            else:
                leaves.append(node)

        walk(top, True)
        if not tree:  # one chunk computes the whole gradient
            return {"parts": {self.chunk(grad): [grad]}, "tree": [], "cast": None}
        if cast is not None:
            tree.append(grad)
        by_chunk: dict[int, list[fx.Node]] = {}
        for leaf in leaves:
            by_chunk.setdefault(self.chunk(leaf), []).append(leaf)
        return {"parts": by_chunk, "tree": tree, "cast": cast}

    def build_chunk(self, c, fwd_nodes, bwd_nodes, sends, grad_sends, loss) -> Chunk:
        recv = sends[c - 1] if c > 0 else []
        send = sends[c]
        grad_recv = grad_sends[c + 1] if c + 1 < len(sends) else []
        grad_send = grad_sends[c]
        fwd_set, recv_set = set(fwd_nodes), set(recv)
        bwd_set = set(bwd_nodes)
        grads = {name: info for name, info in self.gradient_parts.items() if c in info["parts"]}
        extra_bwd_outputs = [n for info in grads.values() for n in info["parts"][c]]
        # saved: forward-side values this chunk's backward (or its gradient outputs) reads
        saved = []
        for node in [*bwd_nodes, *extra_bwd_outputs]:
            for source in ([node] if node in fwd_set or node in recv_set else node.all_input_nodes):
                if (source in fwd_set or source in recv_set) and source not in saved:
                    saved.append(source)
        saved.sort(key=self.order.get)
        # the parameters cast by copied casts that this chunk reads (casts_read_by_several_chunks)
        cast_here = {i.args[0] for n in [*fwd_nodes, *bwd_nodes] for i in n.all_input_nodes
                     if i in self.input_free and i.target is _CAST}
        external = [n for n in self.program.placeholders()
                    if any(u in fwd_set or u in bwd_set for u in n.users) or n in extra_bwd_outputs or n in cast_here]
        # a buffer this chunk's forward updates is its input too, read or not (spectral_norm writes its
        # `_u` without reading it): the stage carries it, and keeps it where a step is skipped
        updated = {self.buffer_nodes[n] for n in self.buffer_nodes if n in fwd_set}
        external += [n for n in self.program.placeholders() if n not in external and
                     self.specs[n].kind is InputKind.BUFFER and self.specs[n].name in updated]
        params = [n for n in external if self.specs[n].kind in (InputKind.PARAM, InputKind.BUFFER)]
        # the dynamic loss scale's state, which the loss chunk's backward multiplies its tangent by
        scale = [n for n in external if self.specs[n].kind is InputKind.LOSS_SCALE]
        batch = [n for n in external if self.specs[n].kind is InputKind.BATCH]
        other = [n for n in external if n not in params and n not in scale and n not in batch]
        if other:
            raise FxShardError(f"chunk {c} reads {[self.specs[n].name for n in other]}, which only the "
                               f"optimizer may read")
        has_loss = loss in fwd_set
        metrics = [n for n in self.metric_nodes if n in fwd_set]
        buffers = [n for n in self.buffer_nodes if n in fwd_set]
        forward = self.subgraph(fwd_nodes, [*params, *scale, *batch, *recv],
                                [*send, *[s for s in saved if s not in send], *([loss] if has_loss else []), *metrics,
                                 *buffers])
        partials = []
        for name, info in grads.items():
            partials.append((name, info["parts"][c], info["cast"]))
        backward = self.subgraph(bwd_nodes, [*params, *scale, *batch, *saved, *grad_recv],
                                 [*grad_send], partials=partials)
        placeholders = self.program.placeholders()
        leaves = [n for n in placeholders if self.specs[n].kind is InputKind.BATCH]
        backward_input, backward_weight, carry = split_weight_gradients(backward, len(grad_send))
        return Chunk(c, tuple(self.groups[c]), forward, backward,
                     tuple(self.specs[n].name for n in params), tuple(leaves.index(n) for n in batch),
                     tuple(n.name for n in recv), tuple(n.name for n in send), tuple(n.name for n in saved),
                     has_loss, tuple(self.metric_nodes[n] for n in metrics),
                     tuple(n.name for n in grad_recv), tuple(n.name for n in grad_send),
                     tuple(name for name, _, _ in partials), backward_input, backward_weight, carry,
                     tuple(self.buffer_nodes[n] for n in buffers), bool(scale))

    def subgraph(self, nodes, inputs, outputs, partials=()) -> fx.GraphModule:
        graph = Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in inputs:
            if node in env:
                continue
            placeholder = graph.placeholder(node.name)
            placeholder.meta.update(node.meta)
            env[node] = placeholder
        for node in nodes:
            if node in env:
                continue
            self.copy_input_free(graph, env, node)  # each chunk reading a constant holds its own copy
            missing = [i for i in node.all_input_nodes if i not in env]
            if missing:
                raise FxShardError(f"pipeline split: {node.name} ({meta.layer(node)}) reads "
                                   f"{[m.name for m in missing]} that its chunk neither makes nor receives")
            env[node] = graph.node_copy(node, env.get)
        results = [env[n] for n in outputs]
        for name, contributions, cast in partials:
            values = [env[n] for n in contributions]
            total = values[0]
            for value in values[1:]:
                total = self.partial_node(graph, _ADD, (total, value), {}, values[0], name)
            if cast is not None:
                total = self.partial_node(graph, _CAST, (total,), {"dtype": cast}, values[0], name)
            results.append(total)
        graph.output(tuple(results))
        graph.eliminate_dead_code()
        graph.lint()
        return lazy_module(self.program.graph_module, graph)


    def copy_input_free(self, graph: fx.Graph, env: dict, node: fx.Node) -> None:
        """Copy the constants and input-free compute `node` reads (and what they read) into `graph`."""
        for source in node.all_input_nodes:
            if source not in env and (source.op == "get_attr" or source in self.input_free):
                self.copy_input_free(graph, env, source)
                env[source] = graph.node_copy(source, env.get)

    @staticmethod
    def partial_node(graph: fx.Graph, target, args, kwargs, like: fx.Node, param: str) -> fx.Node:
        """A node summing (or casting) a chunk's part of a parameter gradient, with the metadata the
        nodes around it carry (phase, layer, value)."""
        node = graph.call_function(target, args, kwargs)
        node.meta.update({meta.PHASE: meta.BWD, meta.LAYER: meta.layer(like), meta.PARAM: param})
        with like.meta["val"].fake_mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args], **kwargs)
        return node


def split_weight_gradients(backward: fx.GraphModule, sent: int):
    """Split a chunk's backward into the input-gradient part (what the previous chunk waits for) and
    the weight-gradient part (which a zero-bubble schedule runs later).

    Invariant: backward_weight(*inputs, *backward_input(*inputs)[sent:]) followed by the first `sent`
    outputs of backward_input gives backward(*inputs). Returns (input part, weight part, carry names).
    Constants (get_attr) that both parts read are in both; they are never carried.
    """
    graph = backward.graph
    output = next(n for n in graph.nodes if n.op == "output")
    results = list(output.args[0])
    sent_nodes, grad_nodes = results[:sent], results[sent:]

    input_part = ancestors(sent_nodes)
    weight_reads = ancestors(grad_nodes)
    # both parts read placeholders and constants themselves: those are never carried
    weight_part = {n for n in weight_reads if n not in input_part or n.op == "get_attr"}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    read_directly = ("placeholder", "get_attr")
    carry = [n for n in graph.nodes if n in input_part and n.op not in read_directly
             and any(u in weight_part for u in n.users)]
    carry += [n for n in grad_nodes if n in input_part and n.op not in read_directly and n not in carry]

    def build(nodes, inputs, outputs):
        new = Graph()
        env = {}
        for node in inputs:
            env[node] = new.placeholder(node.name)
            env[node].meta.update(node.meta)
        for node in graph.nodes:
            if node in nodes and node.op != "placeholder" and node not in env:
                env[node] = new.node_copy(node, env.get)
        new.output(tuple(env[n] for n in outputs))
        new.lint()
        return lazy_module(backward, new)

    input_graph = build(input_part, placeholders, [*sent_nodes, *carry])
    weight_graph = build(weight_part, [*placeholders, *carry], grad_nodes)
    return input_graph, weight_graph, tuple(n.name for n in carry)
