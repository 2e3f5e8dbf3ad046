"""Hand the optimizer bf16 gradients as they are, where nothing reduces them.

Under `Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` autograd produces each
parameter's gradient in bf16 and the tracer casts it to fp32 right away, so that data-parallel
reductions run in fp32 (with `reduce_dtype` left at param_dtype's there is no such cast: AdamW
takes the bf16 gradient directly anyway). On one device nothing is reduced: the fp32 copy only feeds the optimizer phase, which
reads it twice (the gradient norm and the update). This pass removes such a cast when every reader
of its result is one that takes the bf16 gradient just as well:

    fxshard::adamw_update    widens the gradient exactly as it loads it (one fused kernel on CUDA)
    aten.linalg_vector_norm  with dtype=float32: squares and sums the same fp32 values
    aten.new_zeros           reads only the shape (the norm's accumulator), given dtype explicitly

Per parameter and step that saves writing 4 bytes and reading 2 more than it reads (a 1.6B-parameter
MoE: ~18 GB of memory traffic). AdamW applies clipping's coefficient and a loss scale's inverse
itself (its `grad_scale` argument), so neither reads the copy there. Any other reader (SGD's
arithmetic, clipping's scaling for SGD, a microbatch sum, a reduction) keeps the cast.

The same holds for an FSDP unit on an axis of one rank (every unit at Mesh(dp=1), the expert units
at Mesh(dp=N, ep=N), whose `edp` axis has one rank): its gradient is the concatenation of its
members' flattened gradients, scaled by 1/ep for experts, with no collective. Where such a flat
gradient (`cat` of views of widening casts, then at most a multiplication by a power of two) is read
only by the readers above, the concatenation and the scaling run on the bf16 gradients instead:
half the bytes written and read twice more.

Invariant: the same parameter and optimizer-state updates, bit for bit (the widening is exact,
commutes with views and concatenation, and with a power-of-two scaling of a normal number; AdamW's
arithmetic is unchanged), except for scaled gradients below bf16's normal range (|g| < 2^-126 * ep),
which may round (an fp16 flat gradient that is scaled keeps its fp32 copy: fp16's range is narrow); the gradient-norm metric equal up to the order in which the norm kernel sums.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.graph import Graph, fake_mode_of, lazy_module
from fxshard.program import Program

_aten = torch.ops.aten
_READERS = {torch.ops.fxshard.adamw_update.default, _aten.linalg_vector_norm.default, _aten.new_zeros.default}
_FLATTENS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


def narrow_grads(program: Program) -> Program:
    """`program` without the fp32 copies of bf16 gradients that only the optimizer phase reads;
    `notes["narrow_grads"]` counts them. With none to remove, `program` itself."""
    graph = Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    removed = 0
    for node in list(graph.nodes):
        if not _is_widening_grad_cast(node):
            continue
        (source,) = node.all_input_nodes
        if not _only_optimizer_reads(node):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        removed += 1
    fake_mode = fake_mode_of(graph)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.cat.default and meta.phase(node) == meta.BWD:
            removed += _narrow_flat_gradient(graph, node, fake_mode)
    if not removed:  # e.g. every gradient is reduced over ranks: nothing to narrow
        return program
    graph.lint()
    notes = {**program.notes, "narrow_grads": removed}
    return program.replace(graph_module=lazy_module(program.graph_module, graph), notes=notes)


def _is_widening_grad_cast(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _aten._to_copy.default or meta.phase(node) != meta.BWD:
        return False
    if set(node.kwargs) - {"dtype"} or len(node.all_input_nodes) != 1 or len(node.args) != 1:
        return False
    wide, narrow = node.meta["val"].dtype, node.all_input_nodes[0].meta["val"].dtype
    return wide == torch.float32 and narrow in (torch.bfloat16, torch.float16)


def _only_optimizer_reads(node: fx.Node) -> bool:
    return all(user.target in _READERS and meta.phase(user) == meta.OPTIM and _takes_narrow(user, node)
               for user in node.users)


def _narrow_flat_gradient(graph: fx.Graph, cat: fx.Node, fake_mode) -> int:
    """A one-rank FSDP unit's flat gradient, `cat([view(cast(g)), ...])` (then `* 2^k`), read only by the
    optimizer: concatenated (and scaled) in the gradients' own dtype. Returns the casts removed."""
    parts = cat.args[0]
    if len(cat.args) > 1 and cat.args[1] not in (0, -1) or not isinstance(parts, (list, tuple)):
        return 0
    if not all(isinstance(part, fx.Node) and part.target in _FLATTENS and len(part.users) == 1
               and _is_widening_grad_cast(part.args[0]) and len(part.args[0].users) == 1 for part in parts):
        return 0
    narrow = {part.args[0].all_input_nodes[0].meta["val"].dtype for part in parts}
    if len(narrow) != 1:
        return 0
    chain = [cat]  # the cat, then a scaling by a power of two (1/ep for expert units)
    (dtype,) = narrow
    if len(cat.users) == 1 and dtype == torch.bfloat16:  # exact in bf16 (fp32's exponent range), not in fp16
        (user,) = cat.users
        if (user.target is _aten.mul.Tensor and user.args[0] is cat and isinstance(user.args[1], float)
                and math.frexp(user.args[1])[0] == 0.5 and not user.kwargs):
            chain.append(user)
    if not _only_optimizer_reads(chain[-1]):
        return 0
    for part in parts:
        cast = part.args[0]
        part.replace_input_with(cast, cast.all_input_nodes[0])
        graph.erase_node(cast)
    for node in (*parts, *chain):
        value = node.meta["val"]
        with fake_mode:
            node.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=dtype, device=value.device)
    return len(parts)


def _takes_narrow(user: fx.Node, cast: fx.Node) -> bool:
    """The reader computes the same from the narrow tensor: the norm and zeros only with an explicit
    fp32 dtype, AdamW only in its gradient argument."""
    if user.target is torch.ops.fxshard.adamw_update.default:
        return user.args[1] is cast and all(a is not cast for a in (*user.args[:1], *user.args[2:]))
    return user.kwargs.get("dtype") == torch.float32 and user.args[0] is cast
