"""flash_attention: attention the trace left on the memory-efficient kernel, or on cuDNN's with a
sliding window, runs on flash instead.

On CUDA, an attention call the trace put on the memory-efficient kernel reads its mask as a bias
tensor and computes every block of the score matrix. GPT-OSS's attention with sinks (fxshard/
sink_attention.py) calls that kernel for all its layers: its full-attention layers end up with
`is_causal` (passes/causal_attention.py), its sliding-window layers with a window mask, which the
kernel reads and computes in full although only a band of width W is live. Flash computes both
without a mask, the window as `window_size_left = W - 1` (only the band's blocks), about 2x faster
forward + backward causal (bench/attention_kernels.py) and in proportion to S / W faster windowed.
In bf16 on Hopper, SDPA traces as cuDNN's kernel instead (transformers' Mistral, Qwen2 and Gemma 3
sliding-window layers): cuDNN's op takes no window, so it reads the window as a bias over all S x S
scores, 2-7.7x slower than flash's window on an H200 (bench/attention_kernels.py). Those calls move
too; cuDNN's causal calls and calls without a mask stay (faster than flash there).

Each such forward call and every backward call made from it (they share its random-number state)
become flash's forward and backward (`_flash_attention_forward` / `_backward`, on the same tensors
viewed as batch, sequence, heads), with the same causality, window and scale; the backward keeps the
output and log-sum-exp it was given (sink attention gives others than the forward's). The mask is
recognized by evaluating it (it must read no input of the step, like causal_attention's): every
(L, S) slice is the causal pattern within the last W keys, allowed entries 0 and blocked ones at
most -2^15. Only where flash computes the same: bf16 or fp16 on NVIDIA sm80 or newer, no dropout,
as many key and value heads as query heads, one head size (a multiple of 8, at most 256), a causal
call's query and key lengths equal (the kernels align a causal mask at opposite corners otherwise),
the log-sum-exp a backward is given contiguous fp32, and the kernels' results of the same shapes
(the memory-efficient kernel pads its log-sum-exp to 32 rows: the query length must be a multiple of
32; cuDNN's has a trailing dimension of 1, a view of flash's); the others stay. A result flash lays
out otherwise than the program was traced with is copied into that layout (permuted, made
contiguous, permuted back: ops Inductor compiles).

Invariant: the program computes the same function; the kernels differ in floating-point summation
order only (all accumulate in fp32; a blocked key has weight exactly 0 in each unless its score
exceeds its row's largest by more than 2^15 - 104).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from fxshard.graph import ancestors, call_argument, evaluate, is_pure, reordered
from fxshard.program import Program

aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward.default
FLASH = aten._flash_attention_forward.default
FLASH_BACKWARD = aten._flash_attention_backward.default
BLOCKED = 2.0 ** 15  # an additive mask at or below -BLOCKED blocks a key (as in causal_attention)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What differs between the kernels whose calls move: their backward op, the name of its output
    gradient argument, the backward's arguments that are the forward's results besides output and
    log-sum-exp (random state, cuDNN's sequence bookkeeping) with their indices, the trailing
    dimensions of the log-sum-exp after flash's [B, H, S], and whether calls without a window move
    (cuDNN's own causal kernel is faster than flash's)."""

    backward: object
    grad_name: str
    state: tuple[tuple[str, int], ...]
    lse_tail: tuple[int, ...]
    unwindowed: bool


KERNELS = {
    EFFICIENT: _Kernel(EFFICIENT_BACKWARD, "grad_out_", (("philox_seed", 2), ("philox_offset", 3)), (), True),
    CUDNN: _Kernel(CUDNN_BACKWARD, "grad_out", (("cum_seq_q", 2), ("cum_seq_k", 3), ("max_q", 4), ("max_k", 5),
                                                ("philox_seed", 6), ("philox_offset", 7)), (1,), False),
}


class _Plan:
    """How one memory-efficient or cuDNN forward call moves: its q, k, v, causality, window (None: all keys),
    scale, its getitems by output index, and the backward calls made from it."""

    def __init__(self, forward, q, k, v, is_causal, window, scale, items, backwards):
        self.forward, self.kernel, self.q, self.k, self.v = forward, KERNELS[forward.target], q, k, v
        self.is_causal = is_causal
        self.window, self.scale, self.items, self.backwards = window, scale, items, backwards

    @property
    def flags(self) -> dict:
        left = None if self.window is None else self.window - 1
        return {"scale": self.scale, "window_size_left": left, "window_size_right": None if left is None else 0}


def flash_attention(program: Program) -> Program:
    """`program` with its eligible memory-efficient attention calls on flash (module docstring); the
    same program where none is."""
    graph_module = program.graph_module
    windows: dict = {}
    names = [node.name for node in graph_module.graph.nodes
             if node.target in KERNELS and _plan(node, graph_module, windows) is not None]
    if not names:
        return program
    graph_module = reordered(graph_module, list(graph_module.graph.nodes))  # a copy to rewrite
    graph = graph_module.graph
    copies = {node.name: node for node in graph.nodes}
    windowed, backwards, masks = 0, 0, []
    for name in names:
        plan = _plan(copies[name], graph_module, windows)  # the copy's nodes keep their names
        windowed += plan.window is not None
        masks.append(call_argument(plan.forward, "attn_bias"))
        backwards += _rewrite(graph, plan)
    dead = ancestors(m for m in masks if m is not None)
    moved = {*KERNELS, *(kernel.backward for kernel in KERNELS.values())}
    for node in reversed(list(graph.nodes)):  # the old calls, their getitems, the masks nothing reads
        if node.users or node.op != "call_function":
            continue
        old = node.target in moved or (
            node.target is operator.getitem and getattr(node.args[0], "target", None) in moved)
        if old or (node in dead and is_pure(node)):
            graph.erase_node(node)
    graph.lint()
    graph_module.recompile()
    notes = dict(program.notes, flash_attention=f"{len(names)} attention calls ({windowed} with a sliding window) and "
                                                f"{backwards} backward calls on the flash kernel instead of the "
                                                f"memory-efficient or cuDNN one")
    return program.replace(graph_module=graph_module, notes=notes)


def _rewrite(graph: fx.Graph, plan: _Plan) -> int:
    """Replace `plan`'s forward and backward calls by flash's; returns how many backward calls moved."""
    forward, fake = plan.forward, plan.q.meta["val"].fake_mode
    rows, columns = plan.q.meta["val"].shape[-2], plan.k.meta["val"].shape[-2]

    def call(target, args, kwargs=None, like=forward):
        node = graph.call_function(target, args, kwargs or {})
        node.meta = {key: value for key, value in like.meta.items() if key != "val"}
        values = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with fake:
            node.meta["val"] = target(*values, **(kwargs or {}))
        return node

    with graph.inserting_before(forward):
        q, k, v = (call(aten.transpose.int, (t, 1, 2)) for t in (plan.q, plan.k, plan.v))  # batch, sequence, heads
        flash = call(FLASH, (q, k, v, None, None, rows, columns, 0.0, plan.is_causal, False), plan.flags)
        out, lse, rng, unused = (call(operator.getitem, (flash, i)) for i in range(4))
        out = _in_layout(call, call(aten.transpose.int, (out, 1, 2)), plan.items[0].meta["val"])
        if 1 in plan.items and plan.items[1].meta["val"].dim() == 4:  # cuDNN's: [B, H, S, 1]
            lse = call(aten.unsqueeze.default, (lse, -1))
    plan.items[0].replace_all_uses_with(out)
    if 1 in plan.items:
        plan.items[1].replace_all_uses_with(lse)
    for backward in plan.backwards:
        grad, out_given, lse_given = (call_argument(backward, name)
                                      for name in (plan.kernel.grad_name, "out", "logsumexp"))
        with graph.inserting_before(backward):
            grad, out_given = (call(aten.transpose.int, (t, 1, 2), like=backward) for t in (grad, out_given))
            if lse_given.meta["val"].dim() == 4:
                lse_given = call(aten.squeeze.dim, (lse_given, -1), like=backward)
            new = call(FLASH_BACKWARD, (grad, q, k, v, out_given, lse_given, None, None, rows, columns, 0.0,
                                        plan.is_causal, rng, unused), plan.flags, like=backward)
            for user in list(backward.users):
                grad_of = call(aten.transpose.int, (call(operator.getitem, (new, user.args[1]), like=backward), 1, 2),
                               like=backward)
                user.replace_all_uses_with(_in_layout(lambda *a, **kw: call(*a, **kw, like=backward), grad_of,
                                                      user.meta["val"]))
    return len(plan.backwards)


def _in_layout(call, node: fx.Node, like: torch.Tensor) -> fx.Node:
    """`node`, or where its strides are not `like`'s, a copy laid out as `like` (what reads it was
    traced, and is compiled, for that layout): permuted to `like`'s memory order, made contiguous,
    permuted back."""
    value = node.meta["val"]
    if value.stride() == like.stride():
        return node
    order = sorted(range(like.dim()), key=lambda d: -like.stride()[d])
    back = [order.index(d) for d in range(like.dim())]
    made = call(aten.permute.default, (call(aten.clone.default, (call(aten.permute.default, (node, order)),),
                                            {"memory_format": torch.contiguous_format}), back))
    return made


def _plan(forward: fx.Node, graph_module: fx.GraphModule, windows: dict) -> _Plan | None:
    """How `forward` moves to flash, or None where flash would not compute the same (module docstring).
    `windows` caches each mask's window (`_window`) by the mask node's name."""
    kernel = KERNELS[forward.target]
    q, k, v = (call_argument(forward, name) for name in ("query", "key", "value"))
    if not all(isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in (q, k, v)):
        return None
    query, key, value = (n.meta["val"] for n in (q, k, v))
    if (query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16) or query.dim() != 4
            or key.dtype != query.dtype or value.dtype != query.dtype
            or call_argument(forward, "dropout_p") != 0 or not call_argument(forward, "compute_log_sumexp")
            or not query.shape[1] == key.shape[1] == value.shape[1]
            or not query.shape[-1] == key.shape[-1] == value.shape[-1]
            or query.shape[-1] % 8 or query.shape[-1] > 256
            or (forward.target is EFFICIENT and query.shape[-2] % 32)  # its log-sum-exp padded to 32 rows
            or not _flash_trains_on(query.device, query.shape[-1])):
        return None
    is_causal, scale, mask = (call_argument(forward, name) for name in ("is_causal", "scale", "attn_bias"))
    if is_causal and query.shape[-2] != key.shape[-2]:
        return None  # the memory-efficient kernel aligns a causal mask top-left, flash bottom-right
    window = None
    if mask is not None:
        if is_causal:
            return None
        if mask.name not in windows:
            windows[mask.name] = _window(mask, graph_module, query.shape[-2], key.shape[-2])
        window = windows[mask.name]
        if window is None:
            return None
        is_causal = True
    if window is None and not kernel.unwindowed:
        return None
    items = {}
    for user in forward.users:
        if user.target is not operator.getitem:
            return None
        items[user.args[1]] = user
    if 0 not in items:
        return None
    lse_shape = (*query.shape[:2], query.shape[-2], *kernel.lse_tail)
    backwards = list(dict.fromkeys(u for item in items.values() for u in item.users if u.target is kernel.backward))
    if any(u not in backwards for _, i in kernel.state if i in items for u in items[i].users):
        return None  # its random state read by something else
    for backward in backwards:
        if (any(isinstance(call_argument(backward, name), fx.Node) and call_argument(backward, name) is not items.get(i)
                for name, i in kernel.state)
                or call_argument(backward, "attn_bias") is not mask or call_argument(backward, "dropout_p") != 0
                or (kernel.backward is EFFICIENT_BACKWARD and call_argument(backward, "grad_input_mask")[3])
                or call_argument(backward, "is_causal") != call_argument(forward, "is_causal")
                or call_argument(backward, "scale") != scale
                or any(call_argument(backward, name) is not node for name, node in (("query", q), ("key", k),
                                                                                   ("value", v)))
                or any(u.target is not operator.getitem or u.args[1] > 2 for u in backward.users)
                or not _flat_lse(call_argument(backward, "logsumexp"), lse_shape)):
            return None  # flash's backward reads its log-sum-exp as a contiguous fp32 [B, H, S], strides unchecked
    if 1 in items and tuple(items[1].meta["val"].shape) != lse_shape:
        return None  # padded (a length that is no multiple of 32): what reads it was traced for that
    return _Plan(forward, q, k, v, is_causal, window, scale, items, backwards)


def _flat_lse(node, shape: tuple) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.is_contiguous()
            and tuple(value.shape) == shape)


def _flash_trains_on(device: torch.device, head_dim: int) -> bool:
    """Flash's training kernels run on `device` at `head_dim`: NVIDIA sm80 or newer (not ROCm, whose
    flash differs), and not 192 < head_dim <= 224 on sm86 / sm89 (as SDPA's own checks say)."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    capability = torch.cuda.get_device_capability(device)
    return capability >= (8, 0) and not (capability in ((8, 6), (8, 9)) and 192 < head_dim <= 224)


def _window(mask: fx.Node, graph_module: fx.GraphModule, rows: int, columns: int) -> int | None:
    """W where every (rows, columns) slice of `mask`'s value lets query i see keys i - W + 1 .. i (0
    there, at most -BLOCKED elsewhere); None where it reads an input or is another pattern."""
    needed = ancestors([mask])
    if any(n.op == "placeholder" or not (is_pure(n) or n.op == "get_attr") for n in needed):
        return None
    try:
        value = evaluate(graph_module.graph, graph_module, needed)[mask]
    except (RuntimeError, NotImplementedError):
        return None
    if not isinstance(value, torch.Tensor) or value.is_meta or not value.is_floating_point() or value.dim() < 2 \
            or tuple(value.shape[-2:]) != (rows, columns) or rows != columns:
        return None
    # the same slice repeated (an expanded mask): compared once
    value = value[tuple(0 if stride == 0 else slice(None) for stride in value.stride()[:-2])]
    allowed_last = int((value.reshape(-1, rows, columns)[0, -1] == 0).sum())
    if allowed_last < 1:
        return None  # every key blocked: no window of flash's computes that
    i = torch.arange(rows, device=value.device)
    pattern = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < allowed_last)
    if not (((value == 0) == pattern).all() and ((value <= -BLOCKED) == ~pattern).all()):
        return None
    return allowed_last
