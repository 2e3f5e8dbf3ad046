"""Backends for `fxshard::grouped_mlp`: who runs the grouped GEMMs and the activation.

A backend is four functions over tokens sorted by expert (see grouped_mlp.py for the two layouts,
ragged and capacity slots; `capacity` None or C selects one):

    gemm(x, offsets, w, zero_tail=True, capacity=None)
                                     [T, out]: x[rows of e] @ w[e].T; rows no expert owns: zero in
                                     the ragged layout (zero_tail=False: unspecified, for a consumer
                                     that masks them itself), unspecified in the slot layout (the
                                     CUDA backend computes them: x's padding rows @ w[e].T)
    gemm_wgrad(grad, x, offsets, E, capacity=None)  [E, out, in]: grad[rows of e].T @ x[rows of e]
    act(h, offsets, name, limit, capacity=None)     the activation, zero on rows no expert owns
    act_backward(h, grad, offsets, name, limit, capacity=None)
                                     (d act / d h applied to grad, act), one pass, both zero there

plus `supports(*tensors)`. `backend_for` takes the first registered backend that supports the
call, or the one named by FXSHARD_GROUPED_MLP_BACKEND. Registered here: `cuda` (torch._grouped_mm
for the GEMMs, Triton for the activation; bf16 on Hopper-class GPUs) and `reference` (a host loop
over experts and the activation in PyTorch; runs anywhere, the semantics the others must match).
TransformerEngine's grouped linear would register as one more backend where it is installed.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def expert_of_rows(offsets: Tensor, rows: int, capacity: int | None = None) -> Tensor:
    """[T] int64: the expert owning each row; E for rows no expert owns (past offsets[-1]; in the
    slot layout, the padding after each expert's first min(count, C) rows)."""
    if capacity is None:
        positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
        return torch.searchsorted(offsets, positions, right=True)
    positions = torch.arange(rows, device=offsets.device)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    slot = positions // capacity
    return torch.where(positions % capacity < counts[slot], slot, offsets.shape[0])


def _swiglu(h, limit):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _geglu(h, limit):
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _quick_geglu(h, limit):
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _swiglu_backward(h, grad, limit):
    gate, up = h.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    return torch.cat([grad * up * s * (1 + gate * (1 - s)), grad * gate * s], dim=-1)


def _geglu_backward(h, grad, limit):
    gate, up = h.chunk(2, dim=-1)
    t = torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))
    d_gelu = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * gate ** 2)
    return torch.cat([grad * up * d_gelu, grad * 0.5 * gate * (1 + t)], dim=-1)


def _quick_geglu_backward(h, grad, limit):
    gate, up = h.chunk(2, dim=-1)
    passes_gate, passes_up = gate <= limit, (up >= -limit) & (up <= limit)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    s = torch.sigmoid(1.702 * gate)
    d_gate = grad * (up + 1) * (s + 1.702 * gate * s * (1 - s)) * passes_gate
    return torch.cat([d_gate, grad * gate * s * passes_up], dim=-1)


def _gelu_backward(h, grad, limit):
    return grad * (0.5 * (1 + torch.erf(h / math.sqrt(2))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi))


@dataclass(frozen=True)
class Activation:
    name: str
    gated: bool
    torch: Callable     # (h, limit) -> activation, in plain PyTorch (differentiable)
    backward: Callable  # (h, grad, limit) -> grad_h, written out (checked against autograd of `torch`)


ACTIVATIONS = {a.name: a for a in (
    Activation("swiglu", True, _swiglu, _swiglu_backward),
    Activation("geglu", True, _geglu, _geglu_backward),
    Activation("quick_geglu", True, _quick_geglu, _quick_geglu_backward),
    Activation("gelu", False, lambda h, limit: F.gelu(h), _gelu_backward),
    Activation("relu", False, lambda h, limit: F.relu(h), lambda h, grad, limit: grad * (h > 0)),
)}


def check_slots(op: str, x: Tensor, experts: int, capacity: int | None) -> None:
    """The slot layout needs capacity >= 1 and experts * capacity rows (FxShardError otherwise)."""
    if capacity is not None and (capacity < 1 or x.shape[0] != experts * capacity):
        from ..errors import FxShardError

        raise FxShardError(f"{op}(capacity={capacity}): the slot layout needs capacity >= 1 and x with "
                           f"experts * capacity = {experts} * {capacity} rows, got {x.shape[0]}; pass "
                           "capacity=None for ragged rows")


def _expert_rows(offsets: Tensor, capacity: int | None = None):
    """(expert, row slice) for every expert with rows, read on the host."""
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if capacity is not None:  # the first min(count, C) rows of the expert's slot
            first = expert * capacity
            if end > start:
                yield expert, slice(first, first + min(end - start, capacity))
        elif end > start:
            yield expert, slice(start, end)
        start = end


class ReferenceBackend:
    """Runs anywhere: one matmul per expert on the host's view of the offsets; the activation and its
    derivative in PyTorch."""

    name = "reference"
    host_sync = True  # reads the offsets on the host: cannot be captured in a CUDA graph

    def supports(self, *tensors) -> bool:
        return True

    def gemm(self, x, offsets, w, zero_tail=True, capacity=None):
        out = x.new_zeros(x.shape[0], w.shape[1])
        for expert, rows in _expert_rows(offsets, capacity):
            out[rows] = x[rows] @ w[expert].t()
        return out

    def gemm_wgrad(self, grad, x, offsets, experts, capacity=None):
        result = grad.new_zeros(experts, grad.shape[1], x.shape[1])
        for expert, rows in _expert_rows(offsets, capacity):
            result[expert] = grad[rows].t() @ x[rows]
        return result

    def act(self, h, offsets, name, limit, capacity=None):  # computed in fp32 at least, as the kernels do
        wide = torch.promote_types(h.dtype, torch.float32)
        owned = _owned(offsets, h.shape[0], capacity)
        return torch.where(owned, ACTIVATIONS[name].torch(h.to(wide), limit), 0).to(h.dtype)

    def act_backward(self, h, grad, offsets, name, limit, capacity=None):
        wide = torch.promote_types(h.dtype, torch.float32)
        spec = ACTIVATIONS[name]
        owned = _owned(offsets, h.shape[0], capacity)
        wide_h, wide_grad = torch.where(owned, h.to(wide), 0), torch.where(owned, grad.to(wide), 0)
        return spec.backward(wide_h, wide_grad, limit).to(h.dtype), spec.torch(wide_h, limit).to(h.dtype)


def _owned(offsets: Tensor, rows: int, capacity: int | None) -> Tensor:
    """[T, 1] bool: the rows an expert owns."""
    return (expert_of_rows(offsets, rows, capacity) < offsets.shape[0]).unsqueeze(1)


class CudaBackend:
    """torch._grouped_mm (CUTLASS grouped GEMM, bf16, sm90+) and Triton activation kernels that also
    zero rows no expert owns (the GEMM leaves rows past offsets[-1] unwritten). In the slot layout
    every expert has C rows, so the GEMMs are cuBLAS batched GEMMs (torch.bmm on [E, C, .] views:
    94% / 89% of the dense rate at the bench's shapes against 77% / 73% for the grouped GEMM on
    ragged rows, H200, bench/RESULTS.md); the padding rows they compute are masked by the
    activation kernels, so they reach no result."""

    name = "cuda"

    def supports(self, *tensors) -> bool:
        if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors):
            return False
        if not _has_grouped_gemm(tensors[0].device.index or 0):
            return False
        return all(s % 8 == 0 for t in tensors for s in t.shape[-1:])  # 16-byte rows for the GEMM

    def gemm(self, x, offsets, w, zero_tail=True, capacity=None):
        if capacity is not None:
            slots = x.reshape(w.shape[0], capacity, x.shape[1])
            return torch.bmm(slots, w.transpose(-2, -1)).view(x.shape[0], w.shape[1])
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        return _zero_tail(out, offsets) if zero_tail else out

    def gemm_wgrad(self, grad, x, offsets, experts, capacity=None):
        if capacity is not None:
            return torch.bmm(grad.reshape(experts, capacity, grad.shape[1]).transpose(1, 2),
                             x.reshape(experts, capacity, x.shape[1]))
        # experts with no rows get zeros (checked: tests/test_gpu.py, zero-token experts)
        return torch._grouped_mm(grad.t(), x, offs=offsets)

    host_sync = False

    def act(self, h, offsets, name, limit, capacity=None):
        from ._triton_grouped_mlp import activation_forward

        return activation_forward(h, offsets, name, limit, capacity)

    def act_backward(self, h, grad, offsets, name, limit, capacity=None):
        from ._triton_grouped_mlp import activation_backward

        return activation_backward(h, grad, offsets, name, limit, capacity)


@functools.lru_cache(maxsize=None)
def _has_grouped_gemm(device_index: int) -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _zero_tail(out: Tensor, offsets: Tensor) -> Tensor:
    """Rows past offsets[-1] set to zero, in place, without a host sync (dropless routing has none)."""
    from ._triton_grouped_mlp import zero_tail_

    return zero_tail_(out, offsets)


BACKENDS: dict[str, object] = {}


def register_backend(backend, first: bool = False) -> None:
    """Add a backend (see the module docstring for what it provides); `first` gives it priority."""
    global BACKENDS
    items = [(backend.name, backend)] + [(k, v) for k, v in BACKENDS.items() if k != backend.name]
    BACKENDS = dict(items if first else items[1:] + items[:1])


register_backend(CudaBackend())
register_backend(ReferenceBackend())


def backend_for(*tensors):
    forced = os.environ.get("FXSHARD_GROUPED_MLP_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"FXSHARD_GROUPED_MLP_BACKEND={forced!r}: registered backends are {list(BACKENDS)}")
        return BACKENDS[forced]
    return next(b for b in BACKENDS.values() if b.supports(*tensors))
