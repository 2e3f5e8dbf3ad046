"""Lowering for execution: keep SMs free of matmuls while an expert-parallel all-to-all is in flight.

An NCCL all-to-all runs as a kernel that needs SMs of its own. A persistent GEMM (CUTLASS grouped
GEMM, cuBLAS) launched next to it is sized for every SM of the GPU, so the SMs the all-to-all holds
leave part of its tiles for a second wave: measured on an H200 with ep=2, the experts' weight
gradient GEMM took 56% longer while a dispatch was in flight, which cancelled what overlapping the
dispatch saved. torch's experimental SM carveout makes matmuls launched while it is set use only
(SMs - carveout); this lowering sets it after the first EP all-to-all issue of a stretch in which one
is in flight and clears it after the last wait of that stretch, so exactly the matmuls the passes
placed inside all-to-all windows run narrower. Under CUDA graphs the setting is read at capture.

Invariant: the lowered graph computes the same values as its input; it only adds calls without
outputs that change how many SMs later matmul kernels are launched on.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import meta

_c10d = torch.ops._c10d_functional


@torch.fx.node.has_side_effect
def set_sm_carveout(sms: int | None) -> None:
    """Matmuls launched from here on leave `sms` SMs free (None: use all)."""
    torch._C._set_sm_carveout_experimental(sms)


def carve_out_sms_for_all_to_alls(graph_module: fx.GraphModule, sms: int) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` in which matmuls between an EP all-to-all's issue and wait leave `sms`
    SMs free; and how many such stretches it has."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    in_flight, stretches = set(), 0
    for node in list(graph.nodes):
        if meta.is_moe_all_to_all(node):
            if not in_flight:
                with graph.inserting_after(node):
                    graph.call_function(set_sm_carveout, (sms,))
                stretches += 1
            in_flight.add(node)
        elif node.op == "call_function" and node.target is _c10d.wait_tensor.default and node.args[0] in in_flight:
            in_flight.discard(node.args[0])
            if not in_flight:
                with graph.inserting_after(node):
                    graph.call_function(set_sm_carveout, (None,))
        elif node.op == "output" and in_flight:  # an all-to-all never waited on: clear before returning
            with graph.inserting_before(node):
                graph.call_function(set_sm_carveout, (None,))
    graph.lint()
    return fx.GraphModule(graph_module, graph), stretches
