"""Lowering for execution: keep SMs free of matmuls while NCCL moves data next to them.

An NCCL collective or point-to-point transfer runs as a kernel that needs SMs of its own. A
persistent GEMM (CUTLASS grouped GEMM, cuBLAS) launched next to it is sized for every SM of the GPU,
so the SMs the transfer holds leave part of its tiles for a second wave: measured on an H200 with
ep=2, the experts' weight gradient GEMM took 56% longer while a dispatch was in flight, which
cancelled what overlapping the dispatch saved; in a pp=2 pipeline, whose receives are posted early
and wait on SMs until the peer's data comes, the same GEMMs ran 1.4x longer on the stage that always
had one posted (bench/RESULTS.md). torch's experimental SM carveout makes matmuls launched while it
is set use only (SMs - carveout); this lowering sets it before the matmuls that run while such a
transfer is still in flight and clears it before the next matmul that does not, so only those run
narrower. Under CUDA graphs the setting is read at capture.

Windows, by kind (`carve_out_sms`'s `sms` maps each kind to the SMs it leaves free):

    ep    an expert-parallel all-to-all (route, dispatch, combine): in flight for its bytes' worth of
          matmul work after its issue (carve_out_sms's budget), at most until its wait
    fsdp  any other NCCL collective (ZeRO's all-gathers and reduce-scatters, a pipeline's tied-weight
          and loss all-reduces): the same
    pp    a pipeline receive: from its issue to its wait, whatever that holds (its kernel waits on
          its SMs for the peer, however long that takes); a send: its bytes' worth, as a collective

Where windows of several kinds overlap, the largest carveout among them applies.

Invariant: the lowered graph computes the same values as its input; it only adds calls without
outputs that change how many SMs later matmul kernels are launched on.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .. import meta
from ..graph import flops
from ..ops.p2p import P2P_OPS

_c10d = torch.ops._c10d_functional
_RECV = torch.ops.fxshard.recv.default
CARVEOUT_KINDS = ("ep", "fsdp", "pp")


@torch.fx.node.has_side_effect
def set_sm_carveout(sms: int | None) -> None:
    """Matmuls launched from here on leave `sms` SMs free (None: use all)."""
    torch._C._set_sm_carveout_experimental(sms)


# How long a transfer is in flight, in matmul work: H200, bf16 GEMMs at ~600 TFLOP/s against an
# NVLink all-to-all moving ~500 GB/s per rank (bench/RESULTS.md, 2026-11-23): ~1200 FLOPs per byte.
FLOPS_PER_BYTE = 1200.0


def transfer_kind(node: fx.Node) -> str | None:
    """The carveout kind of a node that issues an NCCL transfer ("ep", "fsdp", "pp"), or None."""
    if node.op != "call_function":
        return None
    if meta.is_moe_all_to_all(node):
        return "ep"
    if node.target in meta.COLLECTIVE_ISSUES:
        return "fsdp"
    if node.target in P2P_OPS:
        return "pp"
    return None


def _budget(node: fx.Node, kind: str, flops_per_byte: float) -> float:
    """Matmul FLOPs during which the transfer `node` issues is taken to be still in flight."""
    if node.target is _RECV:
        return math.inf  # its kernel holds SMs until the peer has sent: until the wait, in the worst case
    sent = node.meta.get(meta.COMM_BYTES)
    if sent is None:
        value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        sent = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
    return sent * flops_per_byte


def carve_out_sms(graph_module: fx.GraphModule, sms: dict[str, int],
                  flops_per_byte: float = FLOPS_PER_BYTE) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` in which the matmuls that run while an NCCL transfer of a kind in
    `sms` ("ep", "fsdp", "pp": see the module docstring) is still moving data leave that many SMs free;
    and how many stretches of such matmuls it has.

    A window (issue to wait) is often longer than the transfer: the passes fill it with all the
    independent work there is. So each collective and send is given a budget of matmul FLOPs, its
    bytes times `flops_per_byte` (the compute that takes as long as the transfer); matmuls after an
    issue spend the budgets of the transfers in flight, oldest first (they run one after another),
    and only matmuls issued while some budget is left run narrower. A receive's budget is unbounded
    (its kernel waits for the peer). `flops_per_byte=math.inf`: every matmul inside a window."""
    unknown = set(sms) - set(CARVEOUT_KINDS)
    if unknown:
        raise ValueError(f"carveout kinds {sorted(unknown)}; known: {CARVEOUT_KINDS}")
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    # [issue, its carveout, FLOPs of matmul work left until its transfer is done], in issue order
    in_flight: list[list] = []
    carved, stretches = None, 0
    for node in list(graph.nodes):
        kind = transfer_kind(node)
        if kind in sms:
            in_flight.append([node, sms[kind], _budget(node, kind, flops_per_byte)])
        elif node.op == "call_function" and node.target is _c10d.wait_tensor.default:
            in_flight = [entry for entry in in_flight if entry[0] is not node.args[0]]
        elif (work := _matmul_flops(node)) is not None:
            want = max((entry[1] for entry in in_flight if entry[2] > 0), default=None)
            if want != carved:
                with graph.inserting_before(node):
                    graph.call_function(set_sm_carveout, (want,))
                stretches += carved is None
                carved = want
            for entry in in_flight:  # the oldest transfer first
                spent = min(entry[2], work)
                entry[2] -= spent
                work -= spent
        elif node.op == "output" and carved is not None:
            with graph.inserting_before(node):
                graph.call_function(set_sm_carveout, (None,))
    graph.lint()
    return fx.GraphModule(graph_module, graph), stretches


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _matmul_flops(node: fx.Node) -> float | None:
    """FLOPs of a matmul node (cuBLAS, or fxshard's grouped expert GEMMs); None for anything else."""
    if node.op != "call_function":
        return None
    if node.target in _MATMULS or (getattr(node.target, "namespace", None) == "fxshard"
                                   and "grouped_m" in str(node.target)):
        return float(flops(node))
    return None
