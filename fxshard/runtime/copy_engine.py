"""Lowering for execution: expert-parallel all-to-alls moved by the GPUs' copy engines, not by SMs.

NCCL's all-to-all is a kernel: while it runs it holds SMs, and the GEMMs the overlap passes place
next to it run slower (bench/RESULTS.md, 2026-11-23: 15-26% longer, the largest part of what
overlap leaves exposed). Between GPUs of one host with peer access, the same exchange can be done
by the copy engines (DMA, no SMs) through symmetric memory, in the spirit of PyTorch's
"low-contention" collectives. Each lowered all-to-all owns a region of one symmetric workspace
(every rank allocates the same layout): at a barrier every rank has reached this all-to-all (so,
in program order, it has finished reading this region's contents from the previous step); each
rank then writes the rows meant for peer p straight into p's region with a peer-to-peer memcpy
(its own rows: a local one); at a second barrier every rank's rows have landed, and the region is
the result. All of it runs on a side stream; the `wait_tensor` the graph already has for the
all-to-all makes the compute stream wait for it there (and not earlier). The barriers are small
kernels of one block each; everything else is copies. Under CUDA graphs it is captured like any
other stream work. Memory: the workspace holds every lowered all-to-all's result at once (the sum
of their sizes, allocated on the first step; `workspace_bytes()`), where NCCL's results are
transient. The functional collectives key pending work by storage, and the regions share one: a
`wait_tensor` on one result also waits for every other copy-engine all-to-all issued before it and
not yet waited for (never less than it needs; a region per allocation would make each wait exact,
at one symmetric allocation and rendezvous per all-to-all).

Invariant: the lowered graph computes the same values as its input: an all_to_all_single with
equal splits delivers chunk `rank` of every peer's input, in peer order, which is what the copies
assemble (bit-identical: they are copies). Only equal splits are lowered (fxshard's EP buffers are
fixed-size per destination); anything else keeps NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from .. import meta
from ..errors import FxShardError

_c10d = torch.ops._c10d_functional

_WORKSPACES: dict[str, tuple[Tensor, object]] = {}  # group name -> (symmetric tensor, its handle)
_RETIRED: list = []  # workspaces outgrown by a larger program: kept, a copy may still be writing one
_STREAMS: dict[int, torch.cuda.Stream] = {}


def _workspace(group_name: str, nbytes: int):
    """The group's symmetric workspace (at least `nbytes`), allocated and exchanged on first use: a
    collective call, which every rank reaches at the same all-to-all. (Two compiled steps on one group
    share it; a larger one replaces it at its first all-to-all, and the old one is kept.)"""
    from torch.distributed import _symmetric_memory as symm

    held = _WORKSPACES.get(group_name)
    if held is None or held[0].numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"copy-engine all-to-all: workspace for {group_name} must be allocated before "
                               "CUDA-graph capture (the warm-up steps do that)")
        if held is not None:
            _RETIRED.append(held)
        try:
            symm.enable_symm_mem_for_group(group_name)
            tensor = symm.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
            held = _WORKSPACES[group_name] = (tensor, symm.rendezvous(tensor, group_name))
        except (RuntimeError, ValueError) as error:
            raise FxShardError(
                f"Config(ep_all_to_all='copy-engine') could not set up {nbytes / 2**30:.2f} GiB of symmetric "
                f"memory for process group {group_name}: {error}. It needs the EP group's GPUs on one host with "
                "peer access (NVLink) and that much free memory; use ep_all_to_all='nccl' otherwise") from error
    return held[1]


def workspace_bytes() -> int:
    """Symmetric memory held by copy-engine all-to-alls in this process (outside torch's allocator stats)."""
    return sum(t.numel() * t.element_size() for t, _ in [*_WORKSPACES.values(), *_RETIRED])


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


class _Done(torch._C._distributed_c10d.Work):
    """What `wait_tensor` waits on: an event recorded on the side stream after the last copy. Holds
    the input until then, so its memory is not handed out again while the copies still read it."""

    def __init__(self, keep_alive: Tensor):
        super().__init__()
        self.event = torch.cuda.Event()
        self.event.record()
        self.keep_alive = keep_alive

    def wait(self, timeout=None) -> bool:
        self.event.wait()
        self.keep_alive = None
        return True


def copy_engine_all_to_all(x: Tensor, output_split_sizes, input_split_sizes, group_name: str, region: int,
                           total_bytes: int) -> Tensor:
    """all_to_all_single(x) with equal splits over `group_name`, moved by peer-to-peer memcpys into
    this call's region (byte offset `region`) of the group's workspace (`total_bytes`: what its
    program's all-to-alls need together). Returns the region at once
    (like the functional collective); read it after `wait_tensor`."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    world, rank = group.size(), group.rank()
    handle = _workspace(group_name, total_bytes)
    x = x.contiguous()
    rows = x.shape[0] // world
    shape, offset = list(x.shape), region // x.element_size()
    stream = _side_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        handle.barrier(channel=0)  # every rank is here: done with this region's previous contents
        for step in range(world):
            peer = (rank + step) % world
            target = handle.get_buffer(peer, shape, x.dtype, offset)
            target[rank * rows:(rank + 1) * rows].copy_(x[peer * rows:(peer + 1) * rows])
        handle.barrier(channel=0)  # every rank's rows for this one have landed
        out = handle.get_buffer(rank, shape, x.dtype, offset)
        torch._C._distributed_c10d._register_work(out, _Done(x))
    return out


_ALIGN = 256  # bytes: every region starts aligned for any dtype and for the copy engines


def lower_all_to_alls_to_copy_engines(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` whose EP all-to-alls (equal splits) run on copy engines, each into its
    own region of one workspace sized for all of them; and how many were lowered."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    lowered = [node for node in graph.nodes if meta.is_moe_all_to_all(node) and _equal_splits(node)]
    regions, total = [], 0
    for node in lowered:  # each one's size: what the EP pass recorded it sends
        regions.append(total)
        total += -(-node.meta[meta.COMM_BYTES] // _ALIGN) * _ALIGN
    for node, region in zip(lowered, regions):
        x, out_splits, in_splits, group_name = node.args[:4]
        node.target = copy_engine_all_to_all
        node.args = (x, out_splits, in_splits, group_name, region, total)
    graph.lint()
    return fx.GraphModule(graph_module, graph), len(lowered)


def _equal_splits(node: fx.Node) -> bool:
    out_splits, in_splits = node.args[1], node.args[2]
    return out_splits == in_splits and (out_splits is None or len(set(out_splits)) <= 1)
