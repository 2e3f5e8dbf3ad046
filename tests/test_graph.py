"""fxshard.graph.inline records the aten ops a function calls, as make_fx would trace them: the same
nodes, arguments, fake values and outputs (hypothesis over random straight-line programs of the
kinds of ops the passes inline: slices, arithmetic with scalars, casts, factories, splits, in-place
accumulation, collectives and their waits), and fxshard's annotations land in the nodes' meta."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard import meta
from fxshard.graph import Graph, inline

_c10d = torch.ops._c10d_functional
ROWS, COLS = 4, 6
# each op: (name, function of (values, a, b) -> a new tensor); a, b index the values made so far (shapes
# differ: each op takes what any earlier one made)
OPS = [
    ("add", lambda v, a, b: v[a] + (v[b] if v[b].shape == v[a].shape else v[b].sum())),
    ("scale", lambda v, a, b: v[a] * 0.5),
    ("rows", lambda v, a, b: v[a][1:3] if v[a].dim() else v[a].neg()),
    ("widen", lambda v, a, b: v[a].to(torch.bfloat16).to(torch.float32)),
    ("zeros", lambda v, a, b: torch.zeros(ROWS, COLS, dtype=torch.float32) if v[a].dim() == 2 else torch.zeros_like(v[a])),
    ("split", lambda v, a, b: v[a].split(1)[-1] if v[a].dim() else v[a].abs()),
    ("accumulate", lambda v, a, b: v[a].clone().add_(v[a])),
    ("all_reduce", lambda v, a, b: _c10d.wait_tensor(_c10d.all_reduce(v[a], "sum", "dp"))),
    ("norm", lambda v, a, b: torch.stack([v[a].norm(), v[b].norm()]).sum()),
    ("clamp", lambda v, a, b: torch.clamp(1.0 / (v[a] + 1e-6), max=1.0)),
    ("sort", lambda v, a, b: torch.sort(v[a].flatten())[0]),
]


def program(steps, outputs):
    def fn(*inputs):
        values = list(inputs)
        for op, a, b in steps:
            values.append(OPS[op][1](values, a % len(values), b % len(values)))
        return [values[i % len(values)] for i in outputs]
    return fn


def structure(graph: fx.Graph, outputs):
    """Each call_function node as (target, args and kwargs with nodes as their position, value's
    shape, dtype and strides), then the outputs' positions."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    def describe(value):
        return tuple(value.shape), value.dtype, value.stride()
    nodes = [(node.target, fx.node.map_arg((node.args, node.kwargs), order.__getitem__),
              torch.utils._pytree.tree_map_only(torch.Tensor, describe, node.meta["val"]))
             for node in graph.nodes if node.op == "call_function"]
    return nodes, [order[node] for node in outputs]


def inlined(fn, count, graph_class=fx.Graph):
    fake = FakeTensorMode()
    graph = graph_class()
    inputs = [graph.placeholder(f"x{i}") for i in range(count)]
    with fake:
        for i, node in enumerate(inputs):
            node.meta["val"] = torch.empty(ROWS, COLS) if i % 2 == 0 else torch.empty(COLS)
    outputs = inline(graph, fn, inputs, fake_mode=fake, phase=meta.FWD)
    return graph, outputs, [node.meta["val"] for node in inputs], fake


@settings(max_examples=4 * settings.default.max_examples)  # cheap: ~10 ms an example
@given(st.lists(st.tuples(st.integers(0, len(OPS) - 1), st.integers(0, 30), st.integers(0, 30)), max_size=8),
       st.lists(st.integers(0, 30), min_size=1, max_size=3), st.integers(1, 3))
def test_inline_inserts_the_nodes_make_fx_traces(steps, outputs, count):
    fn = program(steps, outputs)
    graph, nodes, values, fake = inlined(fn, count)
    with fake:
        traced = make_fx(lambda *args: list(fn(*args)))(*[torch.empty_strided(v.shape, v.stride()) for v in values])
    output_node = next(node for node in traced.graph.nodes if node.op == "output")
    assert structure(graph, nodes) == structure(traced.graph, output_node.args[0])
    assert all(node.meta[meta.PHASE] == meta.FWD for node in graph.nodes if node.op == "call_function")
    # fxshard.graph.Graph (what the passes build: nodes made without torch's SymInt scan) records the
    # same nodes, with the same users, and copies into the same graph
    ours, our_nodes, _, _ = inlined(fn, count, Graph)
    assert structure(ours, our_nodes) == structure(graph, nodes)
    def users(g):
        return [(n.name, [u.name for u in n.users], [i.name for i in n.all_input_nodes]) for n in g.nodes]
    assert users(ours) == users(graph)
    copied = Graph()
    copied.output(copied.graph_copy(graph, {}))
    plain = fx.Graph()
    plain.output(plain.graph_copy(graph, {}))
    assert users(copied) == users(plain) and copied.python_code("self").src == plain.python_code("self").src


def test_annotations_with_fxshard_keys_reach_the_nodes_and_others_do_not():
    def fn(x):
        y = x * 2
        with fx_traceback.annotate({meta.PARAM: "w", "other": 1}):
            z = y + 1
        return [z]
    graph, (out,), _, _ = inlined(fn, 1)
    mul = next(node for node in graph.nodes if node.target is torch.ops.aten.mul.Tensor)
    assert out.meta[meta.PARAM] == "w" and "other" not in out.meta and meta.PARAM not in mul.meta


def test_a_tuple_result_is_read_through_getitems_and_a_returned_input_is_the_input():
    graph, (values, indices, same), _, _ = inlined(lambda x: [*torch.sort(x), x], 1)
    assert values.target is operator.getitem and indices.target is operator.getitem
    assert values.args[0] is indices.args[0] and same.op == "placeholder"
    assert indices.meta["val"].dtype == torch.int64


def test_a_constant_from_outside_the_function_is_refused():
    constant = torch.ones(COLS)
    with pytest.raises(AssertionError, match="constant"):
        inlined(lambda x: [x + constant], 1)
    with pytest.raises(AssertionError, match="constant"):
        inlined(lambda x: [x + torch.tensor([1.0] * COLS)], 1)
