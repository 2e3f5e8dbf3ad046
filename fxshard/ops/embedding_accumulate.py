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
only the rows' traffic. On CUDA `index_put_` with `accumulate=True` sorts the indices and sums each
row's contributions in that order: deterministic, the same under CUDA graph replay as in eager replay.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _rows(total: Tensor, grad: Tensor, indices: Tensor, padding_idx: int) -> tuple[Tensor, Tensor]:
    rows = grad.reshape(-1, total.shape[-1]).to(total.dtype)
    flat = indices.reshape(-1)
    if padding_idx >= 0:
        rows = rows * (flat != padding_idx).unsqueeze(-1).to(rows.dtype)
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
    flat, rows = _rows(total, grad, indices, padding_idx)
    total.index_put_((flat,), rows, accumulate=True)
