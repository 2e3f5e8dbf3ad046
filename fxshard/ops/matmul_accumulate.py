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

`fxshard::matmul_accumulate_` writes the same sum into `total`. The functional GEMM has to copy the
total into a new buffer first (aten's addmm writes its C in place: a copy, then the GEMM), a full
extra pass over the total that made the fused accumulation slower than the unfused one (session 28).
In place, one H200 times a GPT 1b block's five weight gradients of a 2048-token microbatch at 468 us,
against 560 us functional and ~523 us as matmul, cast and add (bench/probes/wgrad_accumulate.py,
bench/RESULTS.md session 34). The runtime lowers the functional op to it where nothing else reads
the old total (fxshard/runtime/reinplace.py `accumulate_in_place`).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

_NO_WIDE_GEMM: list[str] = []  # why this torch's CUDA GEMMs cannot write a wider output, once known


def _wide_gemm(name: str, a: Tensor, dtype: torch.dtype, gemm):
    """`gemm()`: a CUDA GEMM writing `dtype` from `a`'s narrower inputs; None where this torch has no
    such GEMM (an older one: warned once), and the caller rounds the product to a's dtype and casts."""
    if _NO_WIDE_GEMM:
        return None
    try:
        return gemm()
    except (RuntimeError, NotImplementedError) as error:
        _NO_WIDE_GEMM.append(str(error).splitlines()[0][:200])
        warnings.warn(f"fxshard::{name}: this torch's CUDA GEMMs cannot write {dtype} from {a.dtype} inputs "
                      f"({_NO_WIDE_GEMM[0]}); computing matmul, cast (and add) instead", stacklevel=3)
        return None


@torch.library.custom_op("fxshard::matmul_accumulate", mutates_args=())
def matmul_accumulate(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    if total.is_cuda and a.dtype != total.dtype:
        out = _wide_gemm("matmul_accumulate", a, total.dtype, lambda: torch.ops.aten.addmm.dtype(total, a, b, total.dtype))
        return out if out is not None else total + (a @ b).to(total.dtype)
    return torch.addmm(total, a.to(total.dtype), b.to(total.dtype))


@matmul_accumulate.register_fake
def _matmul_accumulate_fake(total, a, b):
    return torch.empty_like(total)


@torch.library.custom_op("fxshard::matmul_wide", mutates_args=())
def matmul_wide(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """`a @ b` written in `dtype` (float32 from bf16/fp16 inputs), the product not rounded to a's dtype:
    the first microbatch's weight gradient, the total the later ones are added into. On CUDA one GEMM
    with a float32 output (`aten.mm.dtype`), where a bf16 GEMM and a cast wrote the product twice."""
    return _product_wide(a, b, dtype)


def _product_wide(a: Tensor, b: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """`matmul_wide`'s product, into `out` where given (a view the `_at_` op made). A plain function,
    so the ops that share it add no second dispatch (each custom-op call costs ~20 us of host time)."""
    if a.is_cuda and a.dtype != dtype:
        if out is None:
            gemm = lambda: torch.ops.aten.mm.dtype(a, b, dtype)  # noqa: E731
        else:
            gemm = lambda: torch.ops.aten.mm.dtype_out(a, b, dtype, out=out)  # noqa: E731
        result = _wide_gemm("matmul_wide", a, dtype, gemm)
        if result is not None:
            return result
        return (a @ b).to(dtype) if out is None else out.copy_(a @ b)
    return torch.mm(a.to(dtype), b.to(dtype), out=out)  # CPU: the exact products summed in `dtype`, as matmul_accumulate


@matmul_wide.register_fake
def _matmul_wide_fake(a, b, dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


@torch.library.custom_op("fxshard::matmul_accumulate_", mutates_args=("total",))
def matmul_accumulate_(total: Tensor, a: Tensor, b: Tensor) -> None:
    """`total += a @ b`, the product not rounded to a's dtype first: `matmul_accumulate` in place."""
    _accumulate(total, a, b)


def _accumulate(total: Tensor, a: Tensor, b: Tensor) -> None:
    """`matmul_accumulate_`'s body, shared with `matmul_accumulate_at_` as a plain function."""
    if total.is_cuda and a.dtype != total.dtype:
        wide = lambda: torch.ops.aten.addmm.dtype_out(total, a, b, total.dtype, out=total)  # noqa: E731
        if _wide_gemm("matmul_accumulate_", a, total.dtype, wide) is None:
            total.add_((a @ b).to(total.dtype))
        return
    total.addmm_(a.to(total.dtype), b.to(total.dtype))


# A unit's flat gradient written where its members' totals accumulate (fxshard/runtime/flat_gradients.py):
# the same GEMMs with their [M, N] output a slice of the flat buffer, viewed inside the op (no aliasing
# view node in the program for codegen to see).

@torch.library.custom_op("fxshard::flat_buffer", mutates_args=())
def flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized 1-D tensor (a unit's flat gradient, whose every element the lowering's ops
    write before it is read)."""
    return torch.empty(numel, dtype=dtype, device=device)


@flat_buffer.register_fake
def _flat_buffer_fake(numel, dtype, device):
    return torch.empty(numel, dtype=dtype, device=device)


def _slot(flat: Tensor, offset: int, rows: int, columns: int) -> Tensor:
    return flat[offset:offset + rows * columns].view(rows, columns)


@torch.library.custom_op("fxshard::matmul_wide_at_", mutates_args=("flat",))
def matmul_wide_at_(flat: Tensor, offset: int, a: Tensor, b: Tensor) -> None:
    """`matmul_wide(a, b, flat.dtype)` written into flat[offset : offset + M*N], viewed [M, N]."""
    _product_wide(a, b, flat.dtype, out=_slot(flat, offset, a.shape[0], b.shape[1]))


@torch.library.custom_op("fxshard::matmul_accumulate_at_", mutates_args=("flat",))
def matmul_accumulate_at_(flat: Tensor, offset: int, a: Tensor, b: Tensor) -> None:
    """`matmul_accumulate_` into flat[offset : offset + M*N], viewed [M, N]."""
    _accumulate(_slot(flat, offset, a.shape[0], b.shape[1]), a, b)


@torch.library.custom_op("fxshard::copy_at_", mutates_args=("flat",))
def copy_at_(flat: Tensor, offset: int, source: Tensor) -> None:
    """`source`'s elements, in order, written into flat[offset : offset + numel]."""
    flat[offset:offset + source.numel()].view(source.shape).copy_(source)
