"""Fold gradient accumulation into the weight-gradient matmuls (Megatron's gradient-accumulation fusion).

With microbatches (`Config(microbatches=M)`, pipelines included) each parameter's gradient is summed
over them: `total + g_m` once per microbatch after the first. Under bf16 compute with float32
gradients (`reduce_dtype`), a weight's `g_m` is a bf16 matmul widened to float32, and the addition
is a memory pass of its own over every such parameter (bench/probes/grad_accumulation.py: 40.6 GB a
step on a stage of GPT 1b at pp=2, M=8). This pass rewrites

    add(total, widen(T(mm(a, b))))    the sum float32; widen: a cast from bf16/fp16 to float32, or
                                      the addition's own type promotion;
                                      T: transposes (aten.t, or permute [1, 0]), any number; total:
                                      float32, or bf16/fp16 (the first microbatch's, which the
                                      addition widened: widened explicitly then)

into `fxshard::matmul_accumulate(total, a, b)` (for an odd number of transposes, of b^T and a^T),
where the matmul, the transposes and the cast have no reader but the addition. On CUDA that op is one
GEMM that adds into the total in its epilogue (fxshard/ops/matmul_accumulate.py), which the runtime
runs in place on the total where nothing else reads it (fxshard/runtime/reinplace.py
`accumulate_in_place`). On by default (`Config(fuse_grad_accumulation)`).

An embedding's gradient is the same kind of sum: `add(total, widen(embedding_dense_backward(grad,
indices, n, padding_idx, False)))` becomes `fxshard::embedding_accumulate(total, grad, indices,
padding_idx)`, which adds the gradient's rows into the total (fxshard/ops/embedding_accumulate.py)
instead of writing a dense [n, d] gradient and adding that (GPT 1b: ~0.8 GB of memory passes a
microbatch for a 32,000 x 2,048 embedding); in place, only the rows move.

The first microbatch's product, which the second's accumulation widens, becomes
`fxshard::matmul_wide(a, b, float32)`: one GEMM writing float32 where a bf16 GEMM and a cast wrote
the product twice (on one H200: a GPT 1b pipeline stage's GPU work 0.5-1.4% less a step).

Invariant: the program computes the same function as its input, except that each rewritten
accumulation adds the matmul's product to the total without rounding it to bf16 first (the product
is exact in float32 before the addition; the input rounded it; the first microbatch's product
likewise), and each embedding's rows are
summed into the float32 total instead of into a bf16 gradient rounded before the addition: every other node, the order of the
fixed nodes and every output are the same. Float32 programs have no widening cast and are returned
unchanged, as are programs without microbatch accumulation.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.graph import Graph, lazy_module
from fxshard.ops import embedding_accumulate, matmul_accumulate  # noqa: F401  (registers the ops)
from fxshard.program import Program

_aten = torch.ops.aten
_WIDENING = {_aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def fuse_grad_accumulation(program: Program) -> Program:
    """`program` with each gradient accumulation of a widened matmul product done by
    `fxshard::matmul_accumulate`, and of a widened embedding gradient by `fxshard::embedding_accumulate`;
    `notes["fuse_grad_accumulation"]` counts them. With none, `program`."""
    if not any(_is_half_product(node) for node in program.graph.nodes):  # nothing to fuse: no copy
        return program
    graph = Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    fused = fuse_in_graph(graph)
    if not fused:
        return program
    graph.lint()
    notes = {**program.notes, "fuse_grad_accumulation": fused}
    return program.replace(graph_module=lazy_module(program.graph_module, graph), notes=notes)


def fuse_in_graph(graph: fx.Graph) -> int:
    """The rewrite, in place on `graph`; returns how many accumulations it fused."""
    fused = 0
    for node in list(graph.nodes):
        found, op = _accumulated_matmul(node), torch.ops.fxshard.matmul_accumulate.default
        if found is None:
            found, op = _accumulated_embedding(node), torch.ops.fxshard.embedding_accumulate.default
        if found is None:
            continue
        total, operands, dead = found
        with graph.inserting_before(node):
            new = graph.call_function(op, (total, *operands))
        new.meta.update(node.meta)  # phase, layer, microbatch, pipeline action, the value's fake tensor
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for chained in dead:  # the cast, the transposes, the matmul or embedding backward: read by nothing now
            graph.erase_node(chained)
        fused += 1
    return fused


def _is_half_product(node: fx.Node) -> bool:
    """`node` is a bf16/fp16 matmul or embedding gradient: what every fused accumulation reads."""
    return (node.op == "call_function" and node.target in (_aten.mm.default, _aten.embedding_dense_backward.default)
            and node.meta["val"].dtype in (torch.bfloat16, torch.float16))


def _float32_sum(node: fx.Node):
    """The fake value of `node` where it is a backward float32 2-d addition of two nodes (an
    accumulation's shape), else None."""
    if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return None
    if meta.phase(node) != meta.BWD or len(node.args) != 2 or not all(isinstance(x, fx.Node) for x in node.args):
        return None
    out = node.meta.get("val")
    return out if out is not None and out.dtype == torch.float32 and out.dim() == 2 else None


def _wide_total(node: fx.Node, total: fx.Node, out):
    """`total` in `out`'s dtype: the first microbatch's widened matmul product computed in that dtype
    (`_wide_product`), as it is, or (the first microbatch's gradient, which the addition widened)
    cast before `node`; None for a total of another dtype."""
    wide = _wide_product(total, out)
    if wide is not None:
        return wide
    dtype = total.meta["val"].dtype
    if dtype == out.dtype:
        return total
    return _widened(node, total, out.dtype) if dtype in (torch.bfloat16, torch.float16) else None


def _wide_product(total: fx.Node, out):
    """Where `total` is widen(T(mm(a, b))) in bf16/fp16, each node read only by the next and `total` by
    the accumulation alone: `fxshard::matmul_wide` of the same operands (of b^T and a^T for an odd
    number of transposes) in `out`'s dtype, in place of that chain; else None."""
    found = _widened_matmul(total, out)
    if found is None or len(total.users) != 1:
        return None
    chain, transposes = found
    mm = chain[-1]
    a, b = mm.args
    operands = (a, b) if transposes % 2 == 0 else _transposed(chain[0], b, a)
    with total.graph.inserting_before(chain[0]):
        wide = total.graph.call_function(torch.ops.fxshard.matmul_wide.default, (*operands, out.dtype))
    _placed_like(wide, mm)
    wide.meta["val"] = out.new_empty(out.shape)
    total.replace_all_uses_with(wide)
    for node in chain:  # the cast, the transposes, the matmul: read by nothing now
        total.graph.erase_node(node)
    return wide


def _accumulated_matmul(node: fx.Node):
    """(total, (a, b), the nodes that go away: cast, transposes, matmul) where `node` is total +
    widen(T(mm(a, b))) in the backward, else None."""
    out = _float32_sum(node)
    if out is None:
        return None
    for total, product in (node.args, node.args[::-1]):
        found = _widened_matmul(product, out)
        if found is None or total.meta["val"].shape != out.shape:
            continue
        chain, transposes = found
        total = _wide_total(node, total, out)
        if total is None:
            continue
        a, b = chain[-1].args
        return total, ((a, b) if transposes % 2 == 0 else _transposed(node, b, a)), chain
    return None


def _accumulated_embedding(node: fx.Node):
    """(total, (grad, indices, padding_idx), the nodes that go away: cast, embedding backward) where
    `node` is total + widen(embedding_dense_backward(grad, indices, n, padding_idx, False)) in the
    backward, else None."""
    out = _float32_sum(node)
    if out is None:
        return None
    for total, product in (node.args, node.args[::-1]):
        chain, source = [], product
        if source.op == "call_function" and source.target in _WIDENING:
            if source.meta["val"].dtype != out.dtype or len(source.users) != 1:
                continue
            chain, source = [source], source.args[0]
        if not (isinstance(source, fx.Node) and source.op == "call_function"
                and source.target is _aten.embedding_dense_backward.default and len(source.users) == 1
                and source.meta["val"].dtype in (torch.bfloat16, torch.float16)
                and source.meta["val"].shape == out.shape and total.meta["val"].shape == out.shape):
            continue
        grad, indices, _, padding_idx, scale_grad_by_freq = source.args
        total = None if scale_grad_by_freq else _wide_total(node, total, out)
        if total is None:
            continue
        return total, (grad, indices, padding_idx), chain + [source]
    return None


def _widened_matmul(node: fx.Node, out) -> tuple[list[fx.Node], int] | None:
    """([cast?, transposes..., mm], how many transposes) when `node` is T(mm(a, b)) in bf16/fp16,
    widened to `out`'s dtype by a cast or by the addition's type promotion, each node read only by
    the next one up; else None."""
    chain, source = [], node
    if node.op == "call_function" and node.target in _WIDENING:
        if node.meta["val"].dtype != out.dtype or len(node.users) != 1:
            return None
        chain, source = [node], node.args[0]
    transposes = 0
    while isinstance(source, fx.Node) and _is_transpose(source) and len(source.users) == 1:
        chain.append(source)
        source, transposes = source.args[0], transposes + 1
    if not (isinstance(source, fx.Node) and source.op == "call_function" and source.target is _aten.mm.default
            and len(source.users) == 1 and source.meta["val"].dtype in (torch.bfloat16, torch.float16)):
        return None
    if node.meta["val"].shape != out.shape:
        return None
    return chain + [source], transposes


def _is_transpose(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is _aten.t.default:
        return True
    return node.target is _aten.permute.default and list(node.args[1]) == [1, 0]


_PLACE = (meta.PHASE, meta.LAYER, meta.MICROBATCH, meta.ACTION, meta.ACTION_INDEX)  # where a node runs, not what it is


def _placed_like(node: fx.Node, anchor: fx.Node) -> None:
    """`node` (a cast or transpose the rewrite adds) runs where `anchor` does; it is not what `anchor`
    is (a parameter's gradient keeps that mark on the accumulation alone)."""
    node.meta.update({key: anchor.meta[key] for key in _PLACE if key in anchor.meta})


def _widened(anchor: fx.Node, value: fx.Node, dtype: torch.dtype) -> fx.Node:
    """`value` cast to `dtype` (what the addition's type promotion did), inserted before `anchor`."""
    with anchor.graph.inserting_before(anchor):
        cast = anchor.graph.call_function(_aten._to_copy.default, (value,), {"dtype": dtype})
    _placed_like(cast, anchor)
    cast.meta["val"] = value.meta["val"].to(dtype)
    return cast


def _transposed(anchor: fx.Node, b: fx.Node, a: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(b^T, a^T): (a @ b)^T as a product, the transposes inserted before `anchor`."""
    graph = anchor.graph
    pair = []
    for operand in (b, a):
        with graph.inserting_before(anchor):
            flipped = graph.call_function(_aten.t.default, (operand,))
        _placed_like(flipped, anchor)
        value = operand.meta["val"]
        flipped.meta["val"] = value.t()
        pair.append(flipped)
    return pair[0], pair[1]
