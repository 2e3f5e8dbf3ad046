"""`fxshard::embedding_accumulate`: an embedding's gradient rows added into a wider total, in place of
the dense gradient.

    out = total + embedding_dense_backward(grad, indices, ...)    total [num_weights, d] float32,
                                                                  grad [..., d] (bf16, fp16 or fp32)

An embedding's backward (`aten.embedding_dense_backward`) writes a dense [num_weights, d] gradient
(zeroed, then the rows scattered in), which gradient accumulation over microbatches then widens and
adds into the float32 total: for GPT 1b's 32,000 x 2,048 embedding ~0.8 GB of memory passes per
microbatch for 2,048 tokens' rows. This op adds the rows into the total directly
(`index_put` with `accumulate=True`, each row widened to the total's dtype first; rows at
`padding_idx` add nothing, as the dense backward leaves that row zero). It changes rounding only: a
token's rows are summed in the total's dtype, not in grad's dtype and rounded first.
`fxshard::embedding_accumulate_` writes into `total`; the runtime lowers the functional op to it where
nothing else reads the old total (fxshard/runtime/reinplace.py `accumulate_in_place`), which leaves
only the rows' traffic. On CUDA the in-place form sorts the indices (stable) and a Triton kernel sums
each index's rows in that order, then adds the sum into the total (fxshard/ops/_triton_embedding.py):
deterministic, the same under CUDA graph replay as in eager replay. torch's `index_put_` with
accumulate, which the functional form and the CPU use, is deterministic as well (it sorts too) but
took ~250 us for 2,048 rows of 2,048 on an H200 (bench/RESULTS.md, session 34).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _rows(total: Tensor, grad: Tensor, indices: Tensor, padding_idx: int) -> tuple[Tensor, Tensor]:
    rows = grad.reshape(-1, total.shape[-1]).to(total.dtype)
    flat = indices.reshape(-1)
    if padding_idx >= 0:  # what the dense backward leaves out, even where it is not finite
        rows = torch.where((flat != padding_idx).unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype))
    return flat, rows


@torch.library.custom_op("fxshard::embedding_accumulate", mutates_args=())
def embedding_accumulate(total: Tensor, grad: Tensor, indices: Tensor, padding_idx: int) -> Tensor:
    flat, rows = _rows(total, grad, indices, padding_idx)
    return total.index_put((flat,), rows, accumulate=True)


@embedding_accumulate.register_fake
def _embedding_accumulate_fake(total, grad, indices, padding_idx):
    return torch.empty_like(total)


@torch.library.custom_op("fxshard::embedding_accumulate_", mutates_args=("total",))
def embedding_accumulate_(total: Tensor, grad: Tensor, indices: Tensor, padding_idx: int) -> None:
    """`embedding_accumulate` written into `total`."""
    if _triton_rows(total, grad):
        from ._triton_embedding import add_rows_

        add_rows_(total, grad.reshape(-1, total.shape[-1]), indices.reshape(-1), padding_idx)
        return
    flat, rows = _rows(total, grad, indices, padding_idx)
    total.index_put_((flat,), rows, accumulate=True)


def _triton_rows(total: Tensor, grad: Tensor) -> bool:
    """The Triton kernel's case: CUDA, a contiguous float32 total, Triton importable."""
    if not (total.is_cuda and total.dtype == torch.float32 and total.is_contiguous() and total.dim() == 2
            and grad.is_floating_point()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
