"""Lowering for execution: collectives moved by the GPUs' copy engines, not by SMs.

An NCCL collective is a kernel: while it runs it holds SMs, and the GEMMs the overlap passes place
next to it run slower (bench/RESULTS.md, 2026-11-23: an EP all-to-all made them 15-26% longer, the
largest part of what overlap left exposed). Between GPUs of one host with peer access, the same
exchange can be done by the copy engines (DMA, no SMs) through symmetric memory, in the spirit of
PyTorch's "low-contention" collectives. Three are lowered:

- `all_to_all_single` with equal splits (the EP pass's dispatch and combine: Config(ep_all_to_all));
- `all_gather_into_tensor` and `reduce_scatter_tensor` (sum or avg: the fsdp pass's gathers and
  gradient reductions: Config(fsdp_collectives)).

Each lowered collective owns a region of its group's symmetric workspace (every rank allocates the
same layout). At a barrier every rank has reached this collective (so, in program order, it has
finished reading whatever the region held before: workspace_plan.py places regions so that this is
enough); each rank then writes what peer p receives straight into p's region with a peer-to-peer
memcpy (its own part: a local one); at a second barrier every rank's part has landed. An all-to-all's
or all-gather's region is its result; a reduce-scatter's holds the other ranks' chunks for this rank,
which one kernel sums with this rank's own chunk, read where it is (not copied), and divides for avg,
into a fresh output (_triton_chunks.py). All of it runs on one side stream;
the `wait_tensor` the graph already has makes the compute stream wait for it there (and not
earlier): each result is its own tensor (its own storage), so a wait waits for its collective and
what the side stream ran before it, never for a collective issued later. The barriers are kernels of
one block (torch's symmetric-memory barrier, which spins on its SM while it waits) or, with
Config(copy_engine_barriers="stream"), CUDA stream memory operations that hold no SM (`_stream_barrier`);
the rest is copies. Under CUDA graphs it is captured like any other stream work. A result
that the program returns (ZeRO-1/2's gathered parameters become the next step's state) is copied out
of the workspace on the side stream, so no state lives in a region that a later collective reuses.

Invariant: the lowered graph computes the same values as its input: the copies assemble exactly what
the collective delivers (bit-identical for the all-to-all and the all-gather; the reduce-scatter's sum
adds the same values, in rank order). Checked on CPU by the SPMD simulator with each rank's workspace
really shared and kept across steps (fxshard/spmd.py: a region reused while a compute node still
reads it changes the results; what it cannot see, a send's or another collective's late read, is
checked on the plan), on GPUs against NCCL (tests/test_gpu.py).

Where a rank waits: before its first barrier and after its second, each collective writes (lowering,
2i+1) and (lowering, 2i+2) into a pinned host word of its device (`_MARKERS`, a one-thread kernel on
the side stream, or with stream barriers two stream memory writes, in stream order, captured by CUDA
graphs like the rest). A barrier that times out
traps and leaves the device unusable; the host can still read the word, and `Watch` does: an odd code
names the collective the side stream stopped in, an even one says it stopped elsewhere. A stream
barrier cannot time out on the device: there `Watch` stops the device itself once the marker has
waited Config(collective_timeout_s) (a device-side assert on a high-priority stream of its own), and
the process exits with status 1 some seconds later unless the runtime has reported the stop by then
(`DeviceStop`: an exit armed without needing the GIL, which a launch blocked behind the wait may hold).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import itertools
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from .. import meta
from ..config import COPY_ENGINE_BARRIERS, COPY_ENGINE_OWN_PARTS
from ..errors import FxShardError
from ..graph import Graph, is_view, mutates, lazy_module
from .workspace_plan import plan_regions

_c10d = torch.ops._c10d_functional

_WORKSPACES: dict[str, tuple[Tensor, object]] = {}  # group name -> (symmetric tensor, its handle)
_RETIRED: list = []  # workspaces outgrown by a larger program: kept, a copy may still be writing one
_STREAMS: dict[int, torch.cuda.Stream] = {}
_MARKERS: dict[int, Tensor] = {}  # device index -> pinned int32 [lowering, code]: how far its side stream got
_LOWERINGS = itertools.count(1)  # numbers each lowering, so a marker names the program it came from


def _workspace(group_name: str, nbytes: int):
    """The group's symmetric workspace (at least `nbytes`), allocated and exchanged on first use: a
    collective call, which every rank reaches at the same collective. (Two compiled steps on one group
    share it; a larger one replaces it at its first collective, and the old one is kept.)

    The device is synchronized after the allocation and after the exchange. torch 2.11 (the GPU
    machines' version) zeroes a new allocation's signal pad with a cudaMemset on the legacy default
    stream, which returns before it runs, queued behind this rank's compute, and uploads the peers'
    pointers the same way during the exchange. A peer whose first barrier reaches this rank's pad
    before that memset runs has its signal erased, and the two ranks' barriers go out of step: a hang
    (pytorch PR 192308 made torch itself wait, after 2.11). This is the likeliest cause of the one
    stall bench/RESULTS.md records (2026-11-28), right after a new workspace's allocation; it was not
    reproduced. Waiting here costs two synchronizations per allocation, during warm-up steps only."""
    from torch.distributed import _symmetric_memory as symm

    held = _WORKSPACES.get(group_name)
    if held is None or held[0].numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"copy-engine collectives: workspace for {group_name} must be allocated before "
                               "CUDA-graph capture (the warm-up steps do that)")
        if held is not None:
            _RETIRED.append(held)
        try:
            symm.enable_symm_mem_for_group(group_name)
            device = torch.device("cuda", torch.cuda.current_device())
            tensor = symm.empty(nbytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)  # the signal pad is zero before the exchange lets a peer signal into it
            handle = symm.rendezvous(tensor, group_name)
            torch.cuda.synchronize(device)  # the peers' pointers are on the device before a barrier reads them
            held = _WORKSPACES[group_name] = (tensor, handle)
        except (RuntimeError, ValueError) as error:
            raise FxShardError(
                f"copy-engine collectives (Config(ep_all_to_all) or Config(fsdp_collectives) 'copy-engine', or "
                f"'auto', the default, which picks them for 2 GPUs of one host with peer access) could not set up "
                f"{nbytes / 2**30:.2f} GiB of symmetric memory for process group {group_name}: {error}. They need "
                "the group's GPUs on one host with peer access (NVLink) and that much free memory; use "
                "ep_all_to_all='nccl' / fsdp_collectives='nccl' otherwise") from error
    return held[1]


def workspace_bytes() -> int:
    """Symmetric memory held by copy-engine collectives in this process (outside torch's allocator stats)."""
    return sum(t.numel() * t.element_size() for t, _ in [*_WORKSPACES.values(), *_RETIRED])


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def marker(index: int) -> Tensor:
    """The pinned host words the side stream of device `index` writes its progress into (`_mark`):
    [lowering, code, marks so far]."""
    if index not in _MARKERS:
        _MARKERS[index] = torch.zeros(3, dtype=torch.int32, pin_memory=True)
    return _MARKERS[index]


@functools.cache
def _mark_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["lowering", "code"])  # one compiled kernel for every value
    def mark(word, lowering, code):
        tl.store(word, lowering)
        tl.store(word + 1, code)
        tl.store(word + 2, tl.load(word + 2) + 1)  # one thread, in stream order: a count, not an atomic
    return mark


def _mark(index: int, lowering: int, code: int, barrier: str = "kernel") -> None:
    """On the current stream: write (lowering, code) into device `index`'s marker and count the mark
    (host memory the device writes through; one thread; ~10 us to launch, nothing under CUDA graphs).
    The count tells `Watch` a side stream that keeps passing the same collective step after step
    from one that stopped in it. With stream barriers (`barrier="stream"`) the two words are written
    by stream memory operations instead, uncounted: a kernel, even of one thread, waits for an SM
    that the GEMMs beside it may hold for a whole GEMM, and would hold back the collective's start
    that the barriers no longer do."""
    if barrier == "stream":
        write_words(marker(index), (lowering, code), "copy-engine marker")
        return
    _mark_kernel()[(1,)](marker(index), lowering, code)


def write_words(words: Tensor, values: tuple[int, ...], what: str) -> None:
    """On the current stream, by stream memory operations (no kernel): `values` into the first 32-bit
    words of `words`, pinned host memory (the same address on the device: unified addressing)."""
    write, _ = _stream_memory_operations()
    stream = torch.cuda.current_stream().cuda_stream
    for offset, value in enumerate(values):
        result = write(stream, words.data_ptr() + 4 * offset, value, 0)
        if result != 0:
            raise RuntimeError(f"{what}: {write.__name__} returned CUresult {result}")


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


BARRIERS = COPY_ENGINE_BARRIERS  # Config(copy_engine_barriers)
_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


def _barrier(handle, kind: str, slot: int, timeout_ms: int) -> None:
    """Every rank of the handle's group reaches this point of its side stream before any goes on.
    `slot`: 0 for a collective's first barrier, 1 for its second (what `_stream_barrier` needs)."""
    if kind == "stream":
        _stream_barrier(handle, slot)
    else:
        handle.barrier(channel=0, timeout_ms=timeout_ms)


@functools.cache
def _stream_memory_operations():
    """The driver's cuStreamWriteValue32 and cuStreamWaitValue32 (ctypes; the _v2 entry points of CUDA 12
    and later), which torch does not expose for waiting."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        found = []
        for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
            function = getattr(driver, name + "_v2", None) or getattr(driver, name)
            function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            function.restype = ctypes.c_int
            found.append(function)
    except (OSError, AttributeError) as error:
        raise FxShardError(f"Config(copy_engine_barriers='stream') needs the CUDA driver's stream memory "
                           f"operations (cuStreamWaitValue32, libcuda.so.1): {error}. Use "
                           "copy_engine_barriers='kernel'") from error
    return found[0], found[1]


@functools.cache
def _stream_barrier_words(pads: tuple[int, ...], rank: int, world: int, pad_bytes: int, slot: int):
    """(words this rank signals on its peers' pads, its own words it waits on and resets) for `slot`:
    uint32 word base + slot * world + sender of a pad, the base in the pad's second half, clear of the
    channels torch's own barrier uses (channel * world + rank)."""
    base = pad_bytes // 4 // 2
    if base + 2 * world > pad_bytes // 4:
        raise FxShardError(f"copy-engine stream barriers: the symmetric-memory signal pad ({pad_bytes} bytes) has no "
                           f"room for {world} ranks; use Config(copy_engine_barriers='kernel')")
    peers = [p for p in range(world) if p != rank]
    return ([pads[p] + 4 * (base + slot * world + rank) for p in peers],
            [pads[rank] + 4 * (base + slot * world + p) for p in peers])


def _stream_barrier(handle, slot: int) -> None:
    """A barrier of stream memory operations on the current stream, holding no SM while it waits
    (2x H200, bench/probes/stream_barrier.py: 40 GEMMs took 5.37 ms beside one waiting, 5.31 alone and
    7.14 beside torch's one-block barrier kernel). This rank writes 1 into its word of `slot` on every
    peer's signal pad (cuStreamWriteValue32: a memory fence first, so the copies before it have landed
    there), waits until each peer's word on its own pad is 1 (cuStreamWaitValue32), and sets those
    back to 0. A collective's two barriers use slots 0 and 1, so consecutive barriers on a group never
    share one: a peer writes into this rank's word of a slot again only after it passed the next
    barrier, whose signal this rank wrote after its reset (behind the fence). Captured by CUDA graphs
    as memory-operation nodes."""
    write, wait = _stream_memory_operations()
    signals, waits = _stream_barrier_words(tuple(handle.signal_pad_ptrs), handle.rank, handle.world_size,
                                           handle.signal_pad_size, slot)
    stream = torch.cuda.current_stream().cuda_stream
    calls = [(write, word, 1, 0) for word in signals] + [(wait, word, 1, _WAIT_EQ) for word in waits]
    for function, word, value, flags in calls + [(write, word, 0, 0) for word in waits]:
        code = function(stream, word, value, flags)
        if code != 0:
            raise RuntimeError(f"copy-engine stream barrier: {function.__name__} returned CUresult {code}")


class DeviceStop:
    """Makes device `index`'s CUDA context fail, as a trapped barrier does: what `Watch` does once a
    stream barrier has waited past the timeout (it cannot give up by itself). A device-side assert on a
    high-priority stream of its own, made with its operand when the watch is (a thread that stops a
    device must not need the caching allocator, whose lock a stuck main thread may hold).

    Whether that assert runs is not up to this thread: a stream wait blocks the hardware queue its
    stream is mapped to, streams share queues (CUDA_DEVICE_MAX_CONNECTIONS), a launch behind a full
    queue blocks, and a main thread blocked in such a launch may hold the GIL. On 2x H200 the rank that
    arrived late to a collective whose peer had already stopped neither asserted nor ran a Python timer
    (NCCL's watchdog ended it with SIGABRT a minute later). So the stop first arms an exit that needs no
    GIL (faulthandler's C thread: every thread's stack on stderr, then status 1) `grace_s` from now,
    and only then launches the assert. `stopped_seen()` disarms it once the runtime has turned the
    CUDA error into its FxShardError; the process then exits with status 1 at interpreter exit
    instead of tearing down groups whose collectives never finished (`expire_process_groups`)."""

    def __init__(self, index: int, grace_s: float = 20.0):
        self.index, self.grace_s = index, grace_s
        self.armed = False
        with torch.cuda.device(index):
            self.stream = torch.cuda.Stream(priority=-1)
            self.false = torch.zeros((), dtype=torch.bool, device=f"cuda:{index}")

    def __call__(self) -> None:
        faulthandler.dump_traceback_later(self.grace_s, exit=True)
        self.armed = True
        print(f"fxshard: cuda:{self.index}'s process exits with status 1 in {self.grace_s:g} s unless the runtime "
              "reports the stop first", file=sys.stderr, flush=True)
        try:
            self._assert()
        except RuntimeError:  # the context failed already: what the stop is for
            pass

    def _assert(self) -> None:
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            torch._assert_async(self.false, "fxshard: a copy-engine collective waited longer than "
                                            "Config(collective_timeout_s)")

    def stopped_seen(self, why: str) -> None:
        """The runtime met the stopped device's error and raises it: no hang is left to end."""
        if self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False
            from .replay_watch import expire_process_groups

            expire_process_groups(why)


def _exchange(x: Tensor, group_name: str, region: int, total_bytes: int, shape: list[int], part_for,
              finish, timeout_ms: int, mark: tuple[int, int] | None, skip_own: bool = False,
              barrier: str = "kernel") -> Tensor:
    """The shared body: on the side stream, barrier; write `part_for(peer)` at rows [rank * n, (rank +
    1) * n) of each peer's region (viewed as `shape`, n = part rows; not this rank's own with
    `skip_own`: `finish` reads that part where it is); barrier; `finish(own region)`.
    A barrier that waits longer than `timeout_ms` (0: forever) traps on the device (torch's symmetric
    memory barrier), which fails the step's next synchronization: a peer that never arrives must not
    hang the job, as NCCL's timeout makes sure for its collectives. `mark` = (lowering, i): the
    barriers are bracketed by the marker writes that let `Watch` name this collective. `barrier`:
    "kernel" (torch's) or "stream" (`_stream_barrier`: no SM held; no device-side timeout, `Watch`
    stops the device instead)."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    world, rank = group.size(), group.rank()
    handle = _workspace(group_name, total_bytes)
    offset = region // x.element_size()
    stream = _side_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if mark is not None:
            _mark(x.device.index, mark[0], 2 * mark[1] + 1, barrier)  # waiting in collective i
        _barrier(handle, barrier, 0, timeout_ms)  # every rank is here: done with the region's old contents
        for step in range(1 if skip_own else 0, world):
            peer = (rank + step) % world
            part = part_for(peer)
            rows = part.shape[0]
            # the own part (step 0) is a DtoD copy: on an H200 in a CUDA graph it holds compute up as a copy
            # kernel would (bench/probes/dtod_stall.py; RESULTS session 30)
            handle.get_buffer(peer, shape, x.dtype, offset)[rank * rows:(rank + 1) * rows].copy_(part)
        _barrier(handle, barrier, 1, timeout_ms)  # every rank's part for this one has landed
        if mark is not None:
            _mark(x.device.index, mark[0], 2 * mark[1] + 2, barrier)  # through collective i
        out = finish(handle.get_buffer(rank, shape, x.dtype, offset))
        torch._C._distributed_c10d._register_work(out, _Done(x))
    return out


def _copied_out(copy_out: bool | Tensor, shape: list[int], like: Tensor):
    """`finish` for results read where they are, or copied into a fresh tensor of `shape` (allocated on
    the compute stream, which reads it after the wait) when the program returns them, or into the
    tensor `copy_out` (a gather into a parameter's own buffer: runtime/reinplace.py)."""
    if copy_out is False:
        return lambda region: region
    out = like.new_empty(shape) if copy_out is True else copy_out
    return lambda region: out.copy_(region)


def copy_engine_all_to_all(x: Tensor, output_split_sizes, input_split_sizes, group_name: str, region: int,
                           total_bytes: int, copy_out: bool = False, timeout_ms: int = 0,
                           mark: tuple[int, int] | None = None, barrier: str = "kernel",
                           skip_own: bool = False) -> Tensor:
    """all_to_all_single(x) with equal splits over `group_name`, into this call's region (byte offset
    `region`) of the group's workspace (`total_bytes`: what its program's plan needs). Returns at once
    (like the functional collective); read it after `wait_tensor`. With `skip_own` this rank's own rows
    of the region are left as they were: its readers take them from `x` (`read_own_part_from_input`)."""
    x = x.contiguous()
    world = dist.distributed_c10d._resolve_process_group(group_name).size()
    rows = x.shape[0] // world
    return _exchange(x, group_name, region, total_bytes, list(x.shape),
                     lambda peer: x[peer * rows:(peer + 1) * rows], _copied_out(copy_out, list(x.shape), x), timeout_ms,
                     mark, skip_own=skip_own, barrier=barrier)


def copy_engine_all_gather(shard: Tensor, world: int, group_name: str, region: int, total_bytes: int,
                           copy_out: bool | Tensor = False, timeout_ms: int = 0, mark: tuple[int, int] | None = None,
                           barrier: str = "kernel") -> Tensor:
    """all_gather_into_tensor(shard, world) over `group_name`: every peer's region gets this rank's
    shard at its rows; `copy_out`: a tensor to copy the result into (all_gather_into_tensor_out)."""
    shard = shard.contiguous()
    shape = [world * shard.shape[0], *shard.shape[1:]]
    return _exchange(shard, group_name, region, total_bytes, shape, lambda peer: shard,
                     _copied_out(copy_out, shape, shard), timeout_ms, mark, barrier=barrier)


def copy_engine_reduce_scatter(x: Tensor, reduce_op: str, world: int, group_name: str, region: int,
                               total_bytes: int, timeout_ms: int = 0, mark: tuple[int, int] | None = None,
                               barrier: str = "kernel") -> Tensor:
    """reduce_scatter_tensor(x, "sum" | "avg", world) over `group_name`: peer p's region gets this rank's
    chunk p at row block `rank`; one kernel sums, in rank order and in fp32, the chunks that landed here
    and this rank's own chunk where it is in `x` (never copied), divides by `world` for avg and rounds
    once into a fresh tensor (_triton_chunks.sum_chunks; NCCL rounds narrower floats at every hop, and
    its avg scales each input by 1/world first, so an fp16 sum that would overflow before the division
    does not here either). fp32 with 2 ranks: bit-identical to NCCL (scaling by 1/2 is exact). The sum,
    the division and the local chunk's copy were three passes over memory (2x H200, GPT 1b ZeRO-3 at
    batch 4: the sum and the division 4.4 ms of kernels a step, the local copies of all the collectives
    3.3 ms, all beside the GEMMs; bench/RESULTS.md 2026-11-28)."""
    from ._triton_chunks import sum_chunks

    x = x.contiguous()
    rows = x.shape[0] // world
    rank = dist.distributed_c10d._resolve_process_group(group_name).rank()
    out = x.new_empty([rows, *x.shape[1:]])  # on the compute stream, which reads it after the wait

    def reduce(landed: Tensor) -> Tensor:
        return sum_chunks(x[rank * rows:(rank + 1) * rows], landed, out, world, rank, reduce_op == "avg")
    return _exchange(x, group_name, region, total_bytes, list(x.shape), lambda peer: x[peer * rows:(peer + 1) * rows],
                     reduce, timeout_ms, mark, skip_own=True, barrier=barrier)


copy_engine_all_to_all.copy_engine_of = "all_to_all_single"  # what the SPMD simulator runs them as
copy_engine_all_gather.copy_engine_of = "all_gather_into_tensor"
copy_engine_reduce_scatter.copy_engine_of = "reduce_scatter_tensor"
_LOWERED = {_c10d.all_to_all_single.default: copy_engine_all_to_all,
            _c10d.all_gather_into_tensor.default: copy_engine_all_gather,
            _c10d.reduce_scatter_tensor.default: copy_engine_reduce_scatter}
COPY_ENGINE_COLLECTIVES = frozenset(_LOWERED.values())


@dataclasses.dataclass(frozen=True)
class CopyEngineLowering:
    """What lower_to_copy_engines did: collectives lowered by kind, and the bytes each group's workspace
    needs (against the bytes the lowered collectives' regions add up to, were none reused)."""
    all_to_alls: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0
    workspace: dict = dataclasses.field(default_factory=dict)  # group name -> bytes
    unshared: dict = dataclasses.field(default_factory=dict)  # group name -> bytes without reuse
    number: int = 0  # what its collectives write into the marker (0: nothing lowered)
    described: tuple[str, ...] = ()  # collective i as an error names it (agreement.describe)
    barriers: str = "kernel"  # Config(copy_engine_barriers)
    own_parts_from_input: int = 0  # all-to-alls whose readers take the own rows from the input

    def line(self) -> str:
        planned = ", ".join(f"{name}: {b / 2**20:.1f} MiB (of {self.unshared[name] / 2**20:.1f} without reuse)"
                            for name, b in sorted(self.workspace.items()))
        barriers = ", stream barriers" if self.barriers == "stream" and self.number else ""
        own = f" ({self.own_parts_from_input} read their own part from the input)" if self.own_parts_from_input else ""
        return (f"{self.all_to_alls} copy-engine all-to-alls{own}, {self.all_gathers} all-gathers, "
                f"{self.reduce_scatters} reduce-scatters" + (f" (workspace {planned}{barriers})" if planned else ""))


AUTO_MEASURED_WORLD = 2  # Config "auto" picks copy engines for jobs of this many GPUs: what bench/RESULTS.md measured


def choose_auto(device: torch.device, world: int, places: list[tuple[str, str, dict[str, bool]]] | None,
                graphed: bool = True) -> tuple[bool, str]:
    """What Config(ep_all_to_all / fsdp_collectives)="auto" means for this job: (copy engines?, why).
    Copy engines where they were measured faster than NCCL (2x H200: ZeRO-3 of GPT 1b 0.98-0.99x of one
    GPU's compiled step against NCCL's 1.02x, batch 1 0.90x against 0.99x; MoE with dual-batch overlap
    57.7-58.0 ms against 61.4, all under CUDA graphs): a `graphed` step (Config(cuda_graphs=True)) of
    `AUTO_MEASURED_WORLD` CUDA processes on one host, on different GPUs, each GPU known to have peer
    access to each other. NCCL everywhere else: replayed eagerly, each copy-engine collective is ~10
    host launches, and MoE's step measured 60.89 ms against NCCL's 59.62 there; also
    NCCL_P2P_DISABLE=1, and ranks that each see only their own GPU (CUDA_VISIBLE_DEVICES), where
    peer access cannot be checked. `places`: every rank's (host, its GPU's UUID, {UUID of each other
    GPU it sees: can it access that GPU's memory}), the same list on every rank (`_place`), so every
    rank decides the same."""
    if device.type != "cuda":
        return False, "not CUDA"
    if not graphed:
        return False, "no CUDA graphs (copy engines were measured faster under them only)"
    if world != AUTO_MEASURED_WORLD:
        return False, f"{world} processes (copy engines were measured on {AUTO_MEASURED_WORLD} GPUs only)"
    if os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return False, "NCCL_P2P_DISABLE is set"
    if places is None or len({host for host, _, _ in places}) != 1:
        return False, "the ranks are on more than one host"
    gpus = [gpu for _, gpu, _ in places]
    if len(set(gpus)) != len(gpus):
        return False, "two ranks share a GPU"
    said = [access.get(b) for a in gpus for b in gpus if a != b for _, gpu, access in places if gpu == a]
    if False in said:
        return False, "the GPUs lack peer access"
    if None in said:
        return False, "each rank sees only its own GPU (CUDA_VISIBLE_DEVICES), so peer access cannot be checked"
    return True, f"{world} GPUs of one host with peer access"


def _place(device: torch.device) -> tuple[str, str, dict[str, bool]]:
    """This rank's (host, its GPU's UUID, {UUID of each other visible GPU: peer access to it})."""
    import socket

    index = device.index if device.index is not None else torch.cuda.current_device()
    host = socket.gethostname()
    try:
        uuid = lambda i: str(torch.cuda.get_device_properties(i).uuid)  # noqa: E731
        return host, uuid(index), {uuid(other): torch.cuda.can_device_access_peer(index, other)
                                   for other in range(torch.cuda.device_count()) if other != index}
    except (AttributeError, RuntimeError):  # a build without device UUIDs: "auto" stays on NCCL
        return host, f"cuda:{index}", {}


def resolve_auto(ep_all_to_all: str, fsdp_collectives: str, device: torch.device,
                 meshed: bool = True, graphed: bool = True) -> tuple[str, str, str | None]:
    """Config's "auto" settings made concrete for this process: (ep_all_to_all, fsdp_collectives, the
    line that says what "auto" chose and why, or None where nothing was "auto"). On CUDA, where either
    is "auto" and the step is `meshed` (it has process groups, so every rank of the job builds it) and
    `graphed`, it gathers every rank's place (`_place`) once; a step without groups has nothing to
    lower and gathers nothing (another rank may not be building one)."""
    if "auto" not in (ep_all_to_all, fsdp_collectives):
        return ep_all_to_all, fsdp_collectives, None
    world = dist.get_world_size() if meshed and dist.is_available() and dist.is_initialized() else 1
    places = None
    if device.type == "cuda" and graphed and world == AUTO_MEASURED_WORLD:
        places = [None] * world
        with torch.cuda.device(device):  # NCCL's object gather uses the current device: this rank's GPU
            dist.all_gather_object(places, _place(device))
    chosen, why = choose_auto(device, world, places, graphed) if meshed else (False, "no process groups")
    pick = "copy-engine" if chosen else "nccl"
    ep_all_to_all, fsdp_collectives = (pick if v == "auto" else v for v in (ep_all_to_all, fsdp_collectives))
    said = pick if device.type == "cuda" else f"{pick}, i.e. the process group's own collectives"  # gloo's on CPU
    return ep_all_to_all, fsdp_collectives, f"collectives 'auto': {said} ({why})"


OWN_PARTS = tuple(p for p in COPY_ENGINE_OWN_PARTS if p != "auto")  # where an all-to-all's readers take this rank's own rows


def resolve_own_part(own_part: str, codegen: bool) -> str:
    """Config(copy_engine_own_part) made concrete: "auto" is "input" under codegen, where Inductor fuses
    the `cat` into each reader's gather (bench/probes/cat_gather.py on an H200: a gather of a cat 67.8
    us, a plain gather 67.6 us, the copy then the gather 100.9 us; MoE at ep=2 0.65-0.72 ms a step
    faster in two jobs, session 32), and "copy" under aten replay, where the `cat` is written out."""
    if own_part == "auto":
        return "input" if codegen else "copy"
    return own_part


def lower_to_copy_engines(graph_module: fx.GraphModule, all_to_alls: bool = True, gathers_and_scatters: bool = False,
                          timeout_s: float | None = None, axes: dict[str, str] | None = None,
                          barriers: str = "kernel", own_part: str = "copy",
                          group_rank=None) -> tuple[fx.GraphModule, CopyEngineLowering]:
    """A copy of `graph_module` whose chosen collectives run on copy engines: EP all-to-alls with equal
    splits (`all_to_alls`), all-gathers and sum/avg reduce-scatters (`gathers_and_scatters`), each in a
    region of its group's workspace that workspace_plan.plan_regions places; their barriers give up
    after `timeout_s` (Config(collective_timeout_s); None: never). `axes` (group name -> mesh axis)
    names the groups in the descriptions `Watch` reports. `barriers` (Config(copy_engine_barriers)):
    each lowered node's `barrier` argument, "kernel" or "stream" (`_stream_barrier`), in the dump.
    `own_part` "input": each all-to-all whose result is read in place skips its own part, and its
    readers take those rows from its input (`read_own_part_from_input`; `group_rank(group name)`
    gives this rank's place in the group, by default from its process group); "copy": the exchange
    copies them into the region."""
    if own_part not in OWN_PARTS:
        raise FxShardError(f"own_part={own_part!r}; choose one of {OWN_PARTS}")
    if barriers not in BARRIERS:
        raise FxShardError(f"copy_engine_barriers={barriers!r}; choose one of {BARRIERS}")
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    if barriers == "stream" and connections.isdigit() and int(connections) < 2:
        raise FxShardError(f"Config(copy_engine_barriers='stream') with CUDA_DEVICE_MAX_CONNECTIONS={connections}: "
                           "a stream wait blocks the hardware queue its stream runs on, and with one queue that is "
                           "every stream's, so the compute would wait with it (no overlap; a rank whose peer needs "
                           "its compute first would hang). Unset it or use copy_engine_barriers='kernel'")
    from .agreement import describe

    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    chosen = [node for node in graph.nodes if _lowerable(node, all_to_alls, gathers_and_scatters)]
    plan = plan_regions(graph, chosen)
    number = next(_LOWERINGS) if chosen else 0
    from_input = 0
    described = tuple(describe(node, (axes or {}).get(node.args[-1], node.args[-1])) for node in chosen)
    for i, node in enumerate(chosen):
        region, total = plan.regions[node], plan.workspace[plan.groups[node]]
        if node.target is _c10d.all_to_all_single.default:
            x, out_splits, in_splits, group_name = node.args[:4]
            node.args = (x, out_splits, in_splits, group_name, region, total, plan.copied_out[node])
        elif node.target is _c10d.all_gather_into_tensor.default:
            shard, world, group_name = node.args
            node.args = (shard, world, group_name, region, total, plan.copied_out[node])
        elif node.target is _c10d.all_gather_into_tensor_out.default:  # into a parameter (runtime/reinplace.py)
            shard, world, group_name = node.args
            node.args = (shard, world, group_name, region, total, node.kwargs["out"])
            node.target = _c10d.all_gather_into_tensor.default
        else:
            x, reduce_op, world, group_name = node.args
            node.args = (x, reduce_op, world, group_name, region, total)
        node.target = _LOWERED[node.target]
        node.kwargs = {"timeout_ms": int(timeout_s * 1000) if timeout_s else 0, "mark": (number, i),
                       "barrier": barriers}
        if own_part == "input" and node.target is copy_engine_all_to_all and not plan.copied_out[node]:
            group_name = node.args[3]
            rank = group_rank(group_name) if group_rank else \
                dist.distributed_c10d._resolve_process_group(group_name).rank()
            if read_own_part_from_input(graph, node, rank):
                node.kwargs = {**node.kwargs, "skip_own": True}
                from_input += 1
    graph.lint()
    kinds = [node.target for node in chosen]
    return lazy_module(graph_module, graph), CopyEngineLowering(
        kinds.count(copy_engine_all_to_all), kinds.count(copy_engine_all_gather),
        kinds.count(copy_engine_reduce_scatter), dict(plan.workspace), dict(plan.unshared), number, described, barriers,
        from_input)


def read_own_part_from_input(graph: fx.Graph, node: fx.Node, rank: int) -> bool:
    """Make every reader of all-to-all `node`'s result read this rank's own rows from the input instead
    of the region: right before each reader, `cat([region rows before, input's own rows, region rows
    after])` in place of the waited result; whether it did. Not where a reader is fixed (an op with a
    kernel of its own would get the cat written out first), the result is only waited on, anything
    writes into the result through a view (each reader's cat is its own copy) or into the input, or
    the input is not fresh compute (a collective's result in a region could be handed to a later
    collective while the cats still read it: regions are planned before this rewrite). Under codegen
    the cat sits in its reader's region, where Inductor can fuse it into the reader's loads
    (bench/probes/cat_gather.py asks whether it does, on CUDA), so the own part is never copied.
    Invariant: every reader sees the same values as before, provided the region's own rows are never
    written (the exchange skips them: `skip_own`)."""
    from ..codegen import is_fixed

    x, out_splits = node.args[0], node.args[1]
    waits = [user for user in node.users if user.target is _c10d.wait_tensor.default]
    readers = [(wait, reader) for wait in waits for reader in wait.users]
    base = x  # the tensor whose memory x is: x may be a view of it
    while base.op == "call_function" and is_view(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    if (not out_splits or len(waits) != len(node.users) or not readers or base.op != "call_function"
            or is_fixed(base) or any(is_fixed(reader) for _, reader in readers)
            or any(mutates(n) for n in [*_readers_through_views(waits), *_readers_through_views([base])])):
        return False
    rows, world = out_splits[0], len(out_splits)
    for wait, reader in readers:
        with graph.inserting_before(reader):
            pieces = []
            for source, start, end in ((wait, 0, rank * rows), (x, rank * rows, (rank + 1) * rows),
                                       (wait, (rank + 1) * rows, world * rows)):
                if end > start:
                    piece = graph.call_function(torch.ops.aten.slice.Tensor, (source, 0, start, end))
                    value = {"val": source.meta["val"][start:end]} if "val" in source.meta else {}
                    piece.meta = {**reader.meta, **value}
                    pieces.append(piece)
            whole = graph.call_function(torch.ops.aten.cat.default, (pieces,))
            whole.meta = {**reader.meta, **({"val": wait.meta["val"]} if "val" in wait.meta else {})}
        reader.replace_input_with(wait, whole)
    return True


def _readers_through_views(nodes: list[fx.Node]) -> list[fx.Node]:
    """Every node that reads one of `nodes` or a view of one (views of views too)."""
    aliases, through = list(nodes), []
    while aliases:
        alias = aliases.pop()
        for user in alias.users:
            through.append(user)
            if is_view(user):
                aliases.append(user)
    return through


class Watch:
    """Names the copy-engine collective a rank's device stopped in, from its marker (host memory, still
    readable after the barrier's trap has made every CUDA call of the process fail).

    `waiting_in()` is for the runtime's error path; `start()` runs a daemon thread that prints the
    same to stderr once the marker has said "waiting" in one collective for `timeout_s`, since the
    CUDA error usually surfaces in the user's code (a `loss.item()`), where fxshard cannot catch it.
    With stream barriers, which wait on the device for as long as it takes, the thread then also
    stops device `device_index` (`DeviceStop`), which is what a kernel barrier's trap does. "Waited"
    means the marker's code and count stayed the same (steps that keep passing one collective at the
    moments the thread looks change the count; stream barriers' marks are not counted, so there it is
    the code alone, looked at every second for the whole timeout).
    """

    def __init__(self, lowering: CopyEngineLowering, word: Tensor, timeout_s: float | None, rank: int = 0,
                 device_index: int | None = None, stopper=None):
        self.lowering, self.word, self.timeout_s, self.rank = lowering, word, timeout_s, rank
        self.stop_device = stopper  # a test's stand-in, on CPU
        if stopper is None and lowering.barriers == "stream" and lowering.number and device_index is not None:
            self.stop_device = DeviceStop(device_index)
        self.reported: str | None = None  # what the thread printed
        self._stop = threading.Event()

    def waiting_in(self) -> str | None:
        """The collective of this lowering whose barriers the side stream is in (or stopped in), or None."""
        number, code = (int(v) for v in self.word.tolist()[:2])
        if number != self.lowering.number or number == 0 or code % 2 == 0:
            return None
        return self.lowering.described[(code - 1) // 2]

    def poll(self, seen: tuple | None, now: float) -> tuple | None:
        """One look of the thread: ((code, count), since) to remember; reports once it has waited `timeout_s`."""
        where = self.waiting_in()
        if where is None:
            return None
        position = (int(self.word[1]), int(self.word[2]))
        if seen is None or seen[0] != position:
            return position, now
        if self.reported is None and self.timeout_s and now - seen[1] >= self.timeout_s:
            self.reported = where
            stream = self.lowering.barriers == "stream"
            print(f"fxshard: rank {self.rank}: waited {now - seen[1]:.0f} s in the copy-engine {where}, longer than "
                  f"Config(collective_timeout_s)={self.timeout_s:g}: a rank of that group stalled or stopped (its own "
                  "log says why). " + ("fxshard stops the device (a device-side assert)" if stream else
                                       "Its barrier traps on the device") + ", so this process's next CUDA call fails",
                  file=sys.stderr, flush=True)
            if stream and self.stop_device is not None:
                self.stop_device()
        return seen

    def start(self) -> None:
        if not self.timeout_s:
            return
        from .replay_watch import poll_in_background

        poll_in_background(self, lambda watch, seen: watch.poll(seen, time.monotonic()), min(1.0, self.timeout_s / 4),
                           f"fxshard-copy-engine-watch-{self.lowering.number}", self._stop)

    def stop(self) -> None:
        self._stop.set()

    def raising(self, where: str) -> None:
        """The runtime is raising the error of the device stopped in `where`: disarm the stop's exit."""
        if isinstance(self.stop_device, DeviceStop):
            self.stop_device.stopped_seen(f"the device stopped in the copy-engine {where}")


def _lowerable(node: fx.Node, all_to_alls: bool, gathers_and_scatters: bool) -> bool:
    if node.op != "call_function":
        return False
    if node.target is _c10d.all_to_all_single.default:
        return all_to_alls and meta.is_moe_all_to_all(node) and _equal_splits(node)
    if node.target in (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default):
        return gathers_and_scatters
    if node.target is _c10d.reduce_scatter_tensor.default:
        if not gathers_and_scatters:
            return False
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        is_float = value is not None and value.is_floating_point()
        return node.args[1] == "sum" or (node.args[1] == "avg" and is_float)  # an integer avg stays on NCCL
    return False


def _equal_splits(node: fx.Node) -> bool:
    out_splits, in_splits = node.args[1], node.args[2]
    return out_splits == in_splits and (out_splits is None or len(set(out_splits)) <= 1)
