"""Triton kernel for fxshard::embedding_accumulate (imported only on CUDA).

The rows are sorted by index (stable, so rows of one index keep their order); the first program of
each run of equal indices sums that run's rows in order and adds the sum into the total's row, the
others return at once. Every element is added in a fixed order, so the result is the same in every
run (torch's `index_put_` with accumulate sorts too, but takes ~250 us for 2,048 rows of 2,048 on an
H200: bench/RESULTS.md, session 34).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _runs_kernel(total_ptr, rows_ptr, sorted_ptr, order_ptr, n, width, padding_idx,
                 BLOCK: tl.constexpr, PADDED: tl.constexpr):
    p = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    index = tl.load(sorted_ptr + p)  # int64, as torch.sort returns them: row offsets do not overflow
    keep = (p == 0) | (tl.load(sorted_ptr + tl.maximum(p - 1, 0)) != index)  # the first of its run
    if PADDED:
        keep = keep & (index != padding_idx)
    if keep:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        q = p
        same = p < n  # true: a tensor, as the loop carries it
        while same:
            row = tl.load(order_ptr + q)
            acc += tl.load(rows_ptr + row * width + columns, mask=mask, other=0.0).to(tl.float32)
            q += 1
            same = (q < n) & (tl.load(sorted_ptr + tl.minimum(q, n - 1)) == index)
        target = total_ptr + index * width + columns
        tl.store(target, tl.load(target, mask=mask) + acc, mask=mask)


def add_rows_(total: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, padding_idx: int) -> None:
    """total[indices[i]] += rows[i] for every i (rows [n, width], any float dtype, summed in float32),
    rows at `padding_idx` (>= 0) left out; `total` a contiguous float32 [num_weights, width]."""
    n, width = rows.shape
    if n == 0:
        return
    ordered, order = torch.sort(indices, stable=True)
    block = min(1024, triton.next_power_of_2(width))
    _runs_kernel[(n, triton.cdiv(width, block))](total, rows.contiguous(), ordered, order, n, width, padding_idx,
                                                 BLOCK=block, PADDED=padding_idx >= 0)
