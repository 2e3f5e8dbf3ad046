"""Lowering for execution: keep SMs free of matmuls while an expert-parallel all-to-all is in flight.

An NCCL all-to-all runs as a kernel that needs SMs of its own. A persistent GEMM (CUTLASS grouped
GEMM, cuBLAS) launched next to it is sized for every SM of the GPU, so the SMs the all-to-all holds
leave part of its tiles for a second wave: measured on an H200 with ep=2, the experts' weight
gradient GEMM took 56% longer while a dispatch was in flight, which cancelled what overlapping the
dispatch saved. torch's experimental SM carveout makes matmuls launched while it is set use only
(SMs - carveout); this lowering sets it before the matmuls that run while an EP all-to-all is still
moving data (estimated from its bytes: see carve_out_sms_for_all_to_alls) and clears it before the
next matmul that does not, so only those run narrower. Under CUDA graphs the setting is read at
capture.

Which matmuls honor it (one H200, torch 2.11, CUDA 13; bench/RESULTS.md, session 26): fxshard's
CUTLASS grouped GEMMs and cuBLASLt do; torch's default cuBLAS path for aten.mm does not (the same
time with and without it). Through cuBLASLt, beside a kernel holding 16 SMs, a 16-SM carveout made
two of three GPT 1b GEMM shapes slower still. So the lowering pays off for the experts' grouped
GEMMs it was built for; it is no remedy for dense GEMMs beside NCCL kernels.

Invariant: the lowered graph computes the same values as its input; it only adds calls without
outputs that change how many SMs later matmul kernels are launched on.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import meta
from ..graph import Graph, flops, lazy_module

_c10d = torch.ops._c10d_functional


@torch.fx.node.has_side_effect
def set_sm_carveout(sms: int | None) -> None:
    """Matmuls launched from here on leave `sms` SMs free (None: use all)."""
    torch._C._set_sm_carveout_experimental(sms)


# How long an all-to-all is in flight, in matmul work: H200, bf16 GEMMs at ~600 TFLOP/s against an
# NVLink all-to-all moving ~500 GB/s per rank (bench/RESULTS.md, 2026-11-23): ~1200 FLOPs per byte.
FLOPS_PER_BYTE = 1200.0


def carve_out_sms_for_all_to_alls(graph_module: fx.GraphModule, sms: int,
                                  flops_per_byte: float = FLOPS_PER_BYTE) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` in which the matmuls that run while an EP all-to-all is still moving
    data leave `sms` SMs free; and how many stretches of such matmuls it has.

    A window (issue to wait) is often longer than the transfer: the passes fill it with all the
    independent work there is. So each all-to-all is given a budget of matmul FLOPs, its bytes times
    `flops_per_byte` (the compute that takes as long as the transfer); matmuls after an issue spend
    the budgets of the all-to-alls in flight, oldest first (they run one after another), and only
    matmuls issued while some budget is left run narrower. `flops_per_byte=math.inf`: every matmul
    inside a window."""
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    in_flight: list[list] = []  # [issue, FLOPs of matmul work left until its transfer is done], in issue order
    carved, stretches = False, 0
    for node in list(graph.nodes):
        if meta.is_moe_all_to_all(node):
            in_flight.append([node, node.meta.get(meta.COMM_BYTES, 0) * flops_per_byte])
        elif node.op == "call_function" and node.target is _c10d.wait_tensor.default:
            in_flight = [entry for entry in in_flight if entry[0] is not node.args[0]]
        elif (flops := _matmul_flops(node)) is not None:
            want = any(budget > 0 for _, budget in in_flight)
            if want != carved:
                with graph.inserting_before(node):
                    graph.call_function(set_sm_carveout, (sms if want else None,))
                carved, stretches = want, stretches + want
            for entry in in_flight:  # the oldest transfer first
                spent = min(entry[1], flops)
                entry[1] -= spent
                flops -= spent
        elif node.op == "output" and carved:
            with graph.inserting_before(node):
                graph.call_function(set_sm_carveout, (None,))
    graph.lint()
    return lazy_module(graph_module, graph), stretches


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _matmul_flops(node: fx.Node) -> float | None:
    """FLOPs of a matmul node (cuBLAS, or fxshard's grouped expert GEMMs); None for anything else."""
    if node.op != "call_function":
        return None
    if node.target in _MATMULS or (getattr(node.target, "namespace", None) == "fxshard"
                                   and "grouped_m" in str(node.target)):
        return float(flops(node))
    return None
