"""runtime/graph_memsets.py's pattern, on CPU: the fill kernel's 32-bit stores write exactly the bytes
the memset node they replace would, or the memset is kept."""

import struct

from hypothesis import given, settings, strategies as st

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
