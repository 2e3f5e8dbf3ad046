"""`fxshard::matmul_accumulate`: a matmul's product added into a wider total, not rounded first.

    out = total + a @ b        total [M, N] float32, a [M, K], b [K, N] (bfloat16, float16 or float32)

Gradient accumulation over microbatches adds each microbatch's weight gradient (a bf16 matmul, cast
to float32) into the float32 total, a separate memory pass over every parameter per microbatch
(bench/probes/grad_accumulation.py: 40.6 GB a step on a stage of GPT 1b at pp=2, M=8). On CUDA this op
is one cuBLAS GEMM with the total as its float32 C (beta = 1, `aten.addmm.dtype`): the epilogue reads
the total while the GEMM's math hides the read (Megatron's gradient-accumulation fusion). Elsewhere
(CPU), addmm on inputs widened to the total's dtype: the same exact products, summed in float32.
Either way the product is not rounded to a's dtype before the addition, which is the one way its
result differs from `total + (a @ b).to(total.dtype)`; that is what runs, with a warning, on a CUDA
torch whose addmm cannot write a wider output.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

_NO_WIDE_GEMM: list[str] = []  # why this torch's CUDA addmm cannot write a wider output, once known


@torch.library.custom_op("fxshard::matmul_accumulate", mutates_args=())
def matmul_accumulate(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    if total.is_cuda and a.dtype != total.dtype and not _NO_WIDE_GEMM:
        try:
            return torch.ops.aten.addmm.dtype(total, a, b, total.dtype)
        except (RuntimeError, NotImplementedError) as error:  # an older torch: no out_dtype GEMM
            _NO_WIDE_GEMM.append(str(error).splitlines()[0][:200])
            warnings.warn(f"fxshard::matmul_accumulate: this torch's CUDA addmm cannot write {total.dtype} from "
                          f"{a.dtype} inputs ({_NO_WIDE_GEMM[0]}); accumulating as matmul, cast, add instead",
                          stacklevel=2)
    if total.is_cuda and a.dtype != total.dtype:
        return total + (a @ b).to(total.dtype)
    return torch.addmm(total, a.to(total.dtype), b.to(total.dtype))


@matmul_accumulate.register_fake
def _matmul_accumulate_fake(total, a, b):
    return torch.empty_like(total)
