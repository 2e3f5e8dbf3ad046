"""causal_attention: an attention mask that is the causal pattern becomes `is_causal=True`.

A library that builds its own attention masks hands scaled-dot-product attention an explicit mask
even when the batch has no padding: transformers' masking_utils keeps the mask while it is being
traced, because skipping it there is a data-dependent check. Such a mask reads no input of the
step. This pass evaluates it once (aten, on the device the graph names) and, where every slice of
it is the causal pattern (query i sees keys 0..i: SDPA's top-left convention, as a boolean mask or
an additive one of 0 and a large negative number, at most -2^15), it takes the mask out of the
attention forward and backward calls that read it and sets their `is_causal` flag instead: the kernel (the one the
trace chose: on CUDA cuDNN's in bf16 / fp16 on Hopper, else the memory-efficient one) skips the
blocks above the diagonal instead of reading a mask (2.2-3.2x faster forward + backward for cuDNN's
on an H200, bench/attention_kernels.py). Switching the kernel is passes/flash_attention.py's (the
memory-efficient kernel's calls without a mask or with a sliding window move to flash).

Invariant: the program computes the same function; an attention call with `is_causal` and with the
equivalent mask differ only in floating-point summation order (a key blocked by -2^15 or less has
weight exactly 0 either way unless its score exceeds its row's largest by more than 2^15 - 104). Calls whose mask reads an input
(padding), is not causal, or whose backward needs the mask's gradient are left as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import ancestors, call_argument, evaluate, is_pure, reordered, set_call_argument
from fxshard.program import Program

aten = torch.ops.aten
BLOCKED = 2.0 ** 15  # an additive mask at or below -BLOCKED blocks a key
# attention op -> the name of its mask argument (each takes `is_causal` too)
ATTENTION_MASKS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "attn_mask",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_efficient_attention_backward.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",  # what bf16 / fp16 SDPA picks on Hopper
    aten._scaled_dot_product_cudnn_attention_backward.default: "attn_bias",
}


def causal_attention(program: Program) -> Program:
    """`program` with causal masks turned into `is_causal` (see the module docstring); the same
    program when no attention call has one."""
    graph_module = program.graph_module
    masks = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION_MASKS:
            mask = call_argument(node, ATTENTION_MASKS[node.target])
            if isinstance(mask, fx.Node):
                masks.setdefault(mask, []).append(node)
    causal = [mask for mask, users in masks.items() if _rewritable(users) and _is_causal(mask, graph_module)]
    if not causal:
        return program
    graph_module = reordered(graph_module, list(graph_module.graph.nodes))  # a copy to rewrite
    copies = {n.name: n for n in graph_module.graph.nodes}
    calls = 0
    for mask in causal:
        for user in masks[mask]:
            node = copies[user.name]
            set_call_argument(node, ATTENTION_MASKS[node.target], None)
            set_call_argument(node, "is_causal", True)
            calls += 1
    computed = ancestors(copies[mask.name] for mask in causal)
    for node in reversed(list(graph_module.graph.nodes)):  # the mask computation nothing reads any more
        if node in computed and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.recompile()
    notes = dict(program.notes, causal_attention=f"{calls} attention calls read a mask that is the causal pattern "
                                                  f"({len(causal)} masks): is_causal=True instead")
    return program.replace(graph_module=graph_module, notes=notes)


def _rewritable(users: list[fx.Node]) -> bool:
    """Every call reading the mask can drop it: no backward asks for the mask's gradient."""
    for node in users:
        names = {argument.name for argument in node.target._schema.arguments}
        if "grad_input_mask" in names and call_argument(node, "grad_input_mask")[3]:
            return False
        if call_argument(node, "dropout_p") != 0:
            return False
    return True


def _is_causal(mask: fx.Node, graph_module: fx.GraphModule) -> bool:
    """The mask reads no input and every (L, S) slice of its value is the causal pattern."""
    needed = ancestors([mask])
    if any(n.op == "placeholder" or not (is_pure(n) or n.op == "get_attr") for n in needed):
        return False
    try:
        value = evaluate(graph_module.graph, graph_module, needed)[mask]
    except (RuntimeError, NotImplementedError):  # e.g. a meta-device constant: leave the mask
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.is_meta:
        return False
    rows, columns = value.shape[-2:]
    allowed = torch.ones(rows, columns, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool((value == allowed).all())
    if not value.is_floating_point():
        return False
    # -inf, dtype.min, or the -65536 SDPA writes for a boolean mask it hands cuDNN: softmax gives such
    # a score exactly 0 unless the row's other scores are 32768 below it
    blocked = value <= -BLOCKED
    return bool(((value == 0) == allowed).all() and (blocked == ~allowed).all())
