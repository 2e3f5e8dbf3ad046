"""Lowering for CUDA graphs: the libraries' small memsets become kernel nodes.

cuBLAS and cuDNN clear a few bytes of workspace before many of their kernels (a GEMM of GPT 1b's QKV
or MLP-in shape, every weight gradient, cuDNN's attention forward and backward: 800 memsets a step on
pipeline stage 0 of GPT 1b at M=8; bench/RESULTS.md, session 36). Captured into a CUDA graph, each
becomes a memset node, and on an H200 a memset node costs far more than its ~1.5 us of work: the
graphed step's trace shows ~3-4 us idle before and after each one, against ~0.45 us between two
kernel nodes (session 39: 5.8 of stage 0's 7.0 ms of gaps between kernels a step sat next to a
memset, 4.5% of the step).

After capture and before the graph is instantiated, `memsets_to_kernels` replaces every small 1-D
memset node of the captured graph with a kernel node that writes the same 32-bit pattern to the same
words (a grid-stride loop, PTX below, loaded through the driver), wired to the same dependencies
and dependents; the memset node is then removed. Memsets it cannot express as 32-bit stores (not
word-aligned, a pitched 2-D one, larger than MAX_BYTES, where the copy engine's memset may be the
better tool) or whose memory is not this device's stay as they are.

Invariant: the rewritten graph writes the same bytes to the same addresses, ordered after and before
the same nodes, so a replay computes bit for bit what the captured one would. Checked on CPU for the
pattern (tests/test_graph_memsets.py: the 32-bit stores write what the memset writes, for any element
size, value, width and alignment) and on a GPU for the graph (tests/test_gpu.py: memset nodes made
through the driver between kernels that write and read the same words, and every graphed-vs-eager
test runs with the rewrite).

It uses the CUDA driver API through ctypes (torch exposes the captured graph, `raw_cuda_graph()`,
but not its nodes). Each memset is replaced whole or not at all. Where the driver refuses (an old
torch without `keep_graph`, a driver without an entry point, an edge with data the queries cannot
report, a graph with allocation nodes, whose nodes cannot be destroyed), the memsets not yet
replaced stay as captured and the report says why. The rewiring and that rollback are checked on
CPU against a driver held in Python (tests/test_graph_memsets.py). Config(cuda_graph_memsets="keep")
skips the rewrite.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

MAX_BYTES = 1 << 20  # larger memsets stay memset nodes
_MEMSET_NODE = 2  # CU_GRAPH_NODE_TYPE_MEMSET
_ALLOCATION_NODES = {10, 11}  # CU_GRAPH_NODE_TYPE_MEM_ALLOC, _MEM_FREE

# fill32(dst, value, words): dst[i] = value for i < words, a grid-stride loop
_FILL32_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry fxshard_fill32(.param .u64 p_dst, .param .u32 p_value, .param .u64 p_words)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [p_dst];
    ld.param.u32 %r1, [p_value];
    ld.param.u64 %rd2, [p_words];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    cvt.u64.u32 %rd3, %r5;
    mov.u32 %r6, %nctaid.x;
    mul.lo.u32 %r7, %r6, %r3;
    cvt.u64.u32 %rd4, %r7;
LOOP:
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd5, %rd3, 2;
    add.s64 %rd6, %rd1, %rd5;
    st.global.u32 [%rd6], %r1;
    add.s64 %rd3, %rd3, %rd4;
    bra.uni LOOP;
DONE:
    ret;
}
"""


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@dataclass(frozen=True)
class MemsetReport:
    """What `memsets_to_kernels` did to one graph."""
    replaced: int = 0
    kept: int = 0  # memsets left as they are: not 32-bit expressible, too large, or another device's memory
    skipped: str | None = None  # why it stopped: the memsets not replaced by then are as captured

    def line(self) -> str:
        if self.skipped and self.replaced:
            return (f"CUDA graph memsets: {self.replaced} replaced by kernel nodes, then the rest left as captured "
                    f"({self.skipped})")
        if self.skipped:
            return f"CUDA graph memsets: left as captured ({self.skipped})"
        return (f"CUDA graph memsets: {self.replaced} replaced by kernel nodes"
                + (f", {self.kept} kept (not 32-bit expressible, over {MAX_BYTES} bytes or another device's)"
                   if self.kept else ""))


class _DriverError(RuntimeError):
    pass


class _Driver:
    """The few driver entry points the rewrite needs. Where the driver has the edge-data forms (_v2,
    CUDA 12.3 and later) they are called with no edge data: plain edges, as stream capture makes them."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        nodes, count = ctypes.POINTER(vp), ctypes.POINTER(size)

        def entry(name, *argtypes):
            function = getattr(lib, name)
            function.argtypes, function.restype = list(argtypes), ctypes.c_int
            return function

        self.get_nodes = entry("cuGraphGetNodes", vp, nodes, count)
        self.node_type = entry("cuGraphNodeGetType", vp, ctypes.POINTER(ctypes.c_int))
        self.memset_params = entry("cuGraphMemsetNodeGetParams", vp, ctypes.POINTER(_MemsetParams))
        self.add_kernel = entry("cuGraphAddKernelNode_v2", ctypes.POINTER(vp), vp, nodes, size,
                                ctypes.POINTER(_KernelParams))
        self.destroy = entry("cuGraphDestroyNode", vp)
        self.load = entry("cuModuleLoadData", ctypes.POINTER(vp), ctypes.c_char_p)
        self.function = entry("cuModuleGetFunction", ctypes.POINTER(vp), vp, ctypes.c_char_p)
        self.pointer_attribute = entry("cuPointerGetAttribute", vp, ctypes.c_int, ctypes.c_uint64)
        self.edge_data = hasattr(lib, "cuGraphNodeGetDependencies_v2")
        if self.edge_data:  # the extra argument: the edges' data, NULL
            self.dependencies = entry("cuGraphNodeGetDependencies_v2", vp, nodes, vp, count)
            self.dependents = entry("cuGraphNodeGetDependentNodes_v2", vp, nodes, vp, count)
            self.add_dependencies = entry("cuGraphAddDependencies_v2", vp, nodes, nodes, vp, size)
        else:
            self.dependencies = entry("cuGraphNodeGetDependencies", vp, nodes, count)
            self.dependents = entry("cuGraphNodeGetDependentNodes", vp, nodes, count)
            self.add_dependencies = entry("cuGraphAddDependencies", vp, nodes, nodes, size)

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise _DriverError(f"{what} returned CUresult {status}")

    def _listed(self, query, handle, what: str) -> list[int]:
        """The node list a (handle, array, [edge data,] count) query fills: sized first, then read."""
        count = ctypes.c_size_t(0)
        extra = (None,) if self.edge_data and query is not self.get_nodes else ()
        self.check(query(handle, None, *extra, ctypes.byref(count)), what)
        if count.value == 0:  # an array with no room is refused (CUDA_ERROR_INVALID_VALUE)
            return []
        found = (ctypes.c_void_p * count.value)()
        self.check(query(handle, found, *extra, ctypes.byref(count)), what)
        return [found[i] for i in range(count.value)]

    def device_of(self, address: int) -> int | None:
        """The ordinal of the device whose memory `address` is, or None where the driver cannot say."""
        ordinal = ctypes.c_int(-1)
        status = self.pointer_attribute(ctypes.byref(ordinal), 9, address)  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        return ordinal.value if status == 0 else None

    def nodes(self, graph) -> list[int]:
        return self._listed(self.get_nodes, graph, "cuGraphGetNodes")

    def edges_of(self, node) -> tuple[list[int], list[int]]:
        """(the nodes `node` depends on, the nodes that depend on it)."""
        return (self._listed(self.dependencies, node, "cuGraphNodeGetDependencies"),
                self._listed(self.dependents, node, "cuGraphNodeGetDependentNodes"))

    def connect(self, graph, source, targets: list[int]) -> None:
        if not targets:
            return
        sources = (ctypes.c_void_p * len(targets))(*([source] * len(targets)))
        to = (ctypes.c_void_p * len(targets))(*targets)
        extra = (None,) if self.edge_data else ()
        self.check(self.add_dependencies(graph, sources, to, *extra, len(targets)), "cuGraphAddDependencies")


@functools.cache
def _driver() -> _Driver:
    return _Driver()


@functools.cache
def _fill32(device: int) -> int:
    """The fill kernel, loaded into `device`'s primary context (current on this thread)."""
    driver = _driver()
    with torch.cuda.device(device):
        torch.cuda.init()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        driver.check(driver.load(ctypes.byref(module), _FILL32_PTX), "cuModuleLoadData")
        driver.check(driver.function(ctypes.byref(function), module, b"fxshard_fill32"), "cuModuleGetFunction")
    return function.value


def fill_pattern(params) -> tuple[int, int] | None:
    """(32-bit word, word count) that the memset `params` writes, or None where 32-bit stores cannot
    express it (not word-aligned, pitched rows, over MAX_BYTES)."""
    size, width, height = params.elementSize, params.width, params.height
    if size not in (1, 2, 4):
        return None
    row = width * size
    total = row * height
    if (height > 1 and params.pitch != row) or total % 4 or params.dst % 4 or total > MAX_BYTES or total == 0:
        return None
    value = params.value & ((1 << (8 * size)) - 1)
    word = {1: value * 0x01010101, 2: value * 0x00010001, 4: value}[size]
    return word, total // 4


def memsets_to_kernels(graph, device: int) -> MemsetReport:
    """Replace the small memset nodes of the captured, not yet instantiated CUDA graph `graph`
    (`torch.cuda.CUDAGraph(keep_graph=True)` after capture) with fill kernel nodes; see the module
    docstring. Instantiate the graph afterwards.

    Each node is replaced whole or not at all: where a driver call fails after the kernel node was
    added, that node is removed again, so the memset stays with its edges. The graph is then valid:
    the memsets replaced before the failure write what they wrote, the rest are as captured, and the
    report says how many of each and why it stopped."""
    replaced = kept = 0
    try:
        driver = _driver()
        raw = graph.raw_cuda_graph()
        memsets, kinds = [], set()
        for node in driver.nodes(raw):
            kind = ctypes.c_int(-1)
            driver.check(driver.node_type(node, ctypes.byref(kind)), "cuGraphNodeGetType")
            kinds.add(kind.value)
            if kind.value == _MEMSET_NODE:
                memsets.append(node)
        if kinds & _ALLOCATION_NODES:  # cuGraphDestroyNode refuses every node of such a graph
            return MemsetReport(kept=len(memsets), skipped="the graph allocates memory (cudaMallocAsync allocator)")
        if not memsets:
            return MemsetReport()
        function = _fill32(device)
        for node in memsets:
            params = _MemsetParams()
            driver.check(driver.memset_params(node, ctypes.byref(params)), "cuGraphMemsetNodeGetParams")
            pattern = fill_pattern(params)
            if pattern is None or driver.device_of(params.dst) != device:  # a fill runs on this device
                kept += 1
                continue
            _replace(driver, raw, node, function, params.dst, *pattern)
            replaced += 1
        return MemsetReport(replaced, kept)
    except Exception as error:  # noqa: BLE001 - the graph stays valid (see above) and the report says why
        return MemsetReport(replaced, kept, skipped=f"{type(error).__name__}: {error}")


def _replace(driver: _Driver, raw, node, function: int, dst: int, word: int, words: int) -> None:
    """Memset node `node` of graph `raw` replaced by a fill kernel node with its edges; on a failure
    after the kernel node was added, that node is removed again and the error raised."""
    before, after = driver.edges_of(node)
    arguments = [ctypes.c_uint64(dst), ctypes.c_uint32(word), ctypes.c_uint64(words)]
    pointers = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in arguments])
    block = 32 if words <= 32 else 256
    launch = _KernelParams(func=function, gridDimX=min((words + block - 1) // block, 1024), gridDimY=1, gridDimZ=1,
                           blockDimX=block, blockDimY=1, blockDimZ=1, sharedMemBytes=0, kernelParams=pointers,
                           extra=None, kern=None, ctx=None)  # the driver copies the arguments
    kernel = ctypes.c_void_p()
    dependencies = (ctypes.c_void_p * max(len(before), 1))(*before)
    driver.check(driver.add_kernel(ctypes.byref(kernel), raw, dependencies if before else None, len(before),
                                   ctypes.byref(launch)), "cuGraphAddKernelNode")
    try:
        driver.connect(raw, kernel.value, after)
        driver.check(driver.destroy(node), "cuGraphDestroyNode")
    except Exception:
        driver.destroy(kernel.value)  # its edges go with it: the memset is as captured
        raise


def new_graph(rewrite: bool) -> torch.cuda.CUDAGraph:
    """A CUDAGraph that keeps its captured graph for `memsets_to_kernels` (when `rewrite` and this
    torch can: keep_graph needs torch 2.8 or later)."""
    if rewrite:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pass
    return torch.cuda.CUDAGraph()


def finish_capture(graph: torch.cuda.CUDAGraph, rewrite: bool, device: int) -> MemsetReport:
    """After capture: the rewrite (when asked and the graph was kept), then instantiation."""
    if not rewrite:
        return MemsetReport(skipped='Config(cuda_graph_memsets="keep")')
    if not hasattr(graph, "instantiate"):
        return MemsetReport(skipped="this torch's CUDAGraph cannot keep its graph (keep_graph: torch >= 2.8)")
    try:
        graph.raw_cuda_graph()
    except RuntimeError as error:  # a graph made without keep_graph
        return MemsetReport(skipped=f"the captured graph is not kept: {str(error).splitlines()[0][:120]}")
    report = memsets_to_kernels(graph, device)
    graph.instantiate()
    return report
