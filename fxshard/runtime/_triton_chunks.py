"""Triton kernel for the copy-engine reduce-scatter's sum (copy_engine.copy_engine_reduce_scatter;
imported only on CUDA, or under TRITON_INTERPRET=1 by its test)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_chunks_kernel(own_ptr, landed_ptr, out_ptr, n, WORLD: tl.constexpr, RANK: tl.constexpr,
                       AVG: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: landed may pass 2**31
    mask = offsets < n
    for r in tl.static_range(WORLD):  # rank order
        if r == RANK:  # this rank's own chunk, read where the caller computed it
            chunk = tl.load(own_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            chunk = tl.load(landed_ptr + n.to(tl.int64) * r + offsets, mask=mask, other=0.0).to(tl.float32)
        if r == 0:
            total = chunk
        else:
            total += chunk
    if AVG:
        total = total * (1.0 / WORLD)  # times float32(1 / world): what torch's div_ by a number does on CUDA
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_chunks(own: torch.Tensor, landed: torch.Tensor, out: torch.Tensor, world: int, rank: int,
               average: bool) -> torch.Tensor:
    """Into `out`: the sum over ranks r, in rank order and in float32, of chunk r, which is `own` for
    r == `rank` and block r of `landed` ([world * numel(out)] elements, what the peers wrote) otherwise;
    times float32(1 / world) when `average` (as torch's CUDA division by a number: bit-identical to
    NCCL's average at two ranks, where both are exact halvings); rounded once to out's dtype. One pass: reads each chunk once,
    writes `out` once (the sum, the division and the local chunk's copy were three passes)."""
    n = out.numel()
    if n:
        block = 1024
        _sum_chunks_kernel[(triton.cdiv(n, block),)](own, landed, out, n, WORLD=world, RANK=rank, AVG=average,
                                                    BLOCK=block)
    return out

