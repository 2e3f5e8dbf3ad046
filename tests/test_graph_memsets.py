"""runtime/graph_memsets.py's pattern, on CPU: the fill kernel's 32-bit stores write exactly the bytes
the memset node they replace would, or the memset is kept."""

import ctypes
import struct

from hypothesis import given, settings, strategies as st

from fxshard.runtime import graph_memsets
from fxshard.runtime.graph_memsets import MAX_BYTES, _MemsetParams, fill_pattern


def memset_bytes(params, base: int, size: int) -> bytearray:
    """A buffer of `size` bytes at device address `base` after the memset `params` (0xEE elsewhere)."""
    memory = bytearray(b"\xee" * size)
    element = (params.value & ((1 << (8 * params.elementSize)) - 1)).to_bytes(params.elementSize, "little")
    for row in range(params.height):
        start = params.dst - base + row * params.pitch
        memory[start:start + params.width * params.elementSize] = element * params.width
    return memory


@given(size=st.sampled_from([1, 2, 4]), value=st.integers(0, 2**32 - 1), width=st.integers(0, 300),
       height=st.integers(1, 3), pad=st.integers(0, 8), offset=st.integers(0, 7))
@settings(max_examples=60)  # pure Python: cheap
def test_the_fill_pattern_writes_what_the_memset_writes(size, value, width, height, pad, offset):
    base = 0x7F0000000000
    row = width * size
    params = _MemsetParams(dst=base + offset, pitch=row + pad * size, value=value, elementSize=size, width=width,
                           height=height)
    expected = memset_bytes(params, base, offset + (row + pad * size) * height + 8)
    pattern = fill_pattern(params)
    total = row * height
    contiguous = height == 1 or pad == 0
    if not (contiguous and total and total % 4 == 0 and offset % 4 == 0):
        assert pattern is None
        return
    word, words = pattern
    assert words * 4 == total
    stored = bytearray(b"\xee" * len(expected))
    stored[offset:offset + total] = struct.pack("<I", word) * words
    assert stored == expected


def test_a_memset_over_max_bytes_is_kept():
    assert fill_pattern(_MemsetParams(dst=0, pitch=MAX_BYTES + 4, value=0, elementSize=4,
                                      width=MAX_BYTES // 4 + 1, height=1)) is None
    assert fill_pattern(_MemsetParams(dst=0, pitch=MAX_BYTES, value=0, elementSize=4, width=MAX_BYTES // 4,
                                      height=1)) == (0, MAX_BYTES // 4)


class FakeDriver:
    """The driver calls memsets_to_kernels makes, on a graph held in Python: nodes 1..`count`, memsets
    (`memsets`: node -> (dst, element size, width, height, pitch)) and kernels, and `edges`; fill
    kernels it adds remember their dst. `fail` ("connect" or "destroy") makes that call fail at the
    `at`-th replacement."""

    def __init__(self, count: int, memsets: dict, edges: set, fail: str | None = None, at: int = 0):
        self.nodes_of = {n: ("memset", memsets[n]) if n in memsets else ("kernel", None) for n in range(1, count + 1)}
        self.edges, self.fail, self.at, self.added = set(edges), fail, at, 0
        self.next_id = count + 1  # handles from 1: a NULL one reads as None
        self.check = graph_memsets._Driver.check

    def nodes(self, raw):
        return sorted(self.nodes_of)

    def node_type(self, node, kind):
        kind._obj.value = {"memset": 2, "alloc": 10}.get(self.nodes_of[node][0], 0)
        return 0

    def memset_params(self, node, params):
        dst, size, width, height, pitch = self.nodes_of[node][1]
        target = params._obj
        target.dst, target.elementSize, target.width, target.height, target.pitch, target.value = \
            dst, size, width, height, pitch, 0
        return 0

    def device_of(self, address):
        return 1 if address == 0x5000 else 0  # memory of another device: kept

    def edges_of(self, node):
        return (sorted(a for a, b in self.edges if b == node), sorted(b for a, b in self.edges if a == node))

    def add_kernel(self, kernel, raw, dependencies, count, launch):
        self.added += 1
        node, self.next_id = self.next_id, self.next_id + 1
        dst = ctypes.cast(launch._obj.kernelParams[0], ctypes.POINTER(ctypes.c_uint64)).contents.value
        self.nodes_of[node] = ("fill", dst)
        self.edges |= {(dependencies[i], node) for i in range(count)}
        kernel._obj.value = node
        return 0

    def connect(self, raw, source, targets):
        if self.fail == "connect" and self.added == self.at:
            raise graph_memsets._DriverError("connect failed")
        self.edges |= {(source, t) for t in targets}

    def destroy(self, node):
        if self.fail == "destroy" and self.added == self.at and self.nodes_of[node][0] == "memset":
            return 1
        del self.nodes_of[node]
        self.edges = {(a, b) for a, b in self.edges if node not in (a, b)}
        return 0

    def named(self):
        """The graph with each fill kernel named as the memset (by its dst) it replaced."""
        by_dst = {p[0]: n for n, (kind, p) in self.nodes_of.items() if kind == "memset"}
        originals = {n: p[0] for n, (kind, p) in self.nodes_of.items() if kind == "memset"}
        rename = {n: ("memset", dst) for n, (kind, dst) in self.nodes_of.items() if kind == "fill"}
        rename.update({n: ("memset", dst) for n, dst in originals.items()})
        assert len(by_dst) == len(originals)
        name = lambda n: rename.get(n, ("node", n))  # noqa: E731
        return {name(n) for n in self.nodes_of}, {(name(a), name(b)) for a, b in self.edges}


def rewrite(driver: FakeDriver) -> graph_memsets.MemsetReport:
    """memsets_to_kernels on `driver`'s graph (the module's driver and fill kernel swapped for the test)."""
    class Graph:
        def raw_cuda_graph(self):
            return 1

    original_driver, original_fill = graph_memsets._driver, graph_memsets._fill32
    graph_memsets._driver, graph_memsets._fill32 = (lambda: driver), (lambda device: 7)
    try:
        return graph_memsets.memsets_to_kernels(Graph(), 0)
    finally:
        graph_memsets._driver, graph_memsets._fill32 = original_driver, original_fill


@given(data=st.data(), count=st.integers(2, 9))
@settings(max_examples=40)  # pure Python: cheap
def test_memset_nodes_are_replaced_with_their_edges_or_left_whole(data, count):
    """Any DAG of kernel and memset nodes (memsets chained, roots, leaves, some not expressible): the
    rewritten graph, each fill kernel named as the memset it replaced, has the same nodes and edges.
    With a driver call failing at one replacement, the graph is the same too (replaced up to there,
    the rest as captured, no stray node) and the report says where it stopped."""
    edges = {(a, b) for b in range(1, count + 1) for a in range(1, b) if data.draw(st.booleans())}
    memsets = {n: (0x1000 * n, 4, data.draw(st.sampled_from([1, 3])), 1, 4) for n in range(1, count + 1)
               if data.draw(st.booleans())}  # width 3 of 4-byte elements: 12 bytes; width 1: 4 (both replaced)
    kept = {n for n in memsets if data.draw(st.booleans())} | ({5} & set(memsets))  # node 5: another device's
    memsets = {n: (dst + (1 if n in kept and n != 5 else 0), *rest)  # unaligned: kept
               for n, (dst, *rest) in memsets.items()}
    fail = data.draw(st.sampled_from([None, "connect", "destroy"]))
    replaceable = len(memsets) - len(kept)
    at = data.draw(st.integers(1, max(replaceable, 1)))
    driver = FakeDriver(count, memsets, edges, fail, at)
    before = FakeDriver(count, memsets, edges).named()

    report = rewrite(driver)
    assert driver.named() == before
    failed = fail is not None and replaceable > 0
    assert report.replaced == (at - 1 if failed else replaceable)
    assert (report.skipped is not None) == failed
    assert sum(kind == "fill" for kind, _ in driver.nodes_of.values()) == report.replaced


def test_a_graph_that_allocates_memory_is_left_as_captured():
    """cuGraphDestroyNode refuses the nodes of a graph with allocation nodes (the cudaMallocAsync
    allocator): such a graph is not touched."""
    driver = FakeDriver(3, {1: (0x1000, 4, 1, 1, 4)}, {(1, 2), (2, 3)})
    driver.nodes_of[3] = ("alloc", None)
    before = driver.named()
    report = rewrite(driver)
    assert driver.named() == before and driver.added == 0
    assert (report.replaced, report.kept) == (0, 1) and "allocates" in report.skipped
