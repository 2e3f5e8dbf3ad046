"""fxshard's own ops called as the Python functions they are, not through the dispatcher.

An op made with `torch.library.custom_op` costs host time per call on its way through the
dispatcher (the schema's argument parsing, the autograd and ADInplaceOrView keys, version counters)
before its Python body runs: 12-29 us a call on the H200 machine's host, 34-120 us on the 2-core CI
machine (bench/probes/op_dispatch.py). An eager replay of a pipeline stage of GPT 1b calls fxshard's
ops ~450 times a step (350 of them the in-place gradient GEMMs), and eager replay is bound by its
host whenever the host runs slow (bench/RESULTS.md session 41: 88-200 ms of CPU a step against ~110
ms of GPU work).

The dispatcher is what tracing, fake tensors and Inductor need; a replay needs none of it: nothing
records autograd there, and the tensors are real. So an eager replay's graph calls each op's body
directly, where the op is fxshard's and has one implementation for every device (no
`register_kernel`, no autocast or vmap rules: the body is all it does). Ops inside compiled regions
are Inductor's to call and stay as they are, and so do the transfers and gloo's all-gathers (~50 calls
a step): the step names a failed one by its op (`CompiledStep._failed_wait`). A step under CUDA graphs
is left as it is: its replay spends no host time on any op.

Invariant: every rewritten node calls the function the dispatcher would have run, with the same
arguments, so the replay computes exactly what it did (tests/test_direct_calls.py: bit for bit, a
step on aten replay and pipeline stages on the SPMD simulator; the codegen tests run with it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch._library.custom_ops import OPDEFS

from ..graph import Graph, lazy_module
from ..ops.gloo import GLOO_ALL_GATHER
from ..ops.p2p import P2P_OPS

NAMESPACE = "fxshard"
COMMUNICATION = P2P_OPS | {GLOO_ALL_GATHER}  # called through the dispatcher: the step's errors name them


def body_of(target) -> Callable | None:
    """The Python function an fxshard custom op's call would run on every device, or None where the
    call must go through the dispatcher (another namespace, several kernels, an op not made by
    `torch.library.custom_op`, a transfer or gather)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE or target in COMMUNICATION:
        return None
    definition = OPDEFS.get(target.name())  # "fxshard::name": custom_op defines one overload, default
    if definition is None or target._overloadname != "default":
        return None
    if set(definition._backend_fns) != {None} or getattr(definition, "_disabled_kernel", ()) \
            or getattr(definition, "_autocast_cuda_dtype", None) is not None \
            or getattr(definition, "_autocast_cpu_dtype", None) is not None or getattr(definition, "_vmap_fn", None):
        return None
    return definition._init_fn  # the function the op was made from, which its one kernel calls


def call_directly(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` whose calls of fxshard ops outside its compiled regions call the ops'
    bodies (`body_of`), and the number of calls rewritten; `graph_module` itself where there is none."""
    if not any(node.op == "call_function" and body_of(node.target) for node in graph_module.graph.nodes):
        return graph_module, 0
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    rewritten = 0
    for node in graph.nodes:
        body = body_of(node.target) if node.op == "call_function" else None
        if body is not None:
            node.target = body
            rewritten += 1
    return lazy_module(graph_module, graph), rewritten
