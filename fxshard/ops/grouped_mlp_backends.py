"""Backends for `fxshard::grouped_mlp`: who runs the grouped GEMMs and the activation.

A backend is four functions over tokens sorted by expert (see grouped_mlp.py for the layout):

    gemm(x, offsets, w, zero_tail=True)  [T, out]: x[rows of e] @ w[e].T, zero past offsets[-1]
                                     (zero_tail=False: rows past it unspecified, for a consumer
                                     that masks them itself)
    gemm_wgrad(grad, x, offsets, E)  [E, out, in]: grad[rows of e].T @ x[rows of e]
    act(h, offsets, name, limit)     the activation, zero past offsets[-1]
    act_backward(h, grad, offsets, name, limit)   (d act / d h applied to grad, act), one pass

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


def expert_of_rows(offsets: Tensor, rows: int) -> Tensor:
    """[T] int64: the expert owning each row; E for rows past offsets[-1]."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


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


def _expert_rows(offsets: Tensor):
    """(expert, row slice) for every expert with rows, read on the host."""
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            yield expert, slice(start, end)
        start = end


class ReferenceBackend:
    """Runs anywhere: one matmul per expert on the host's view of the offsets; the activation and its
    derivative in PyTorch."""

    name = "reference"
    host_sync = True  # reads the offsets on the host: cannot be captured in a CUDA graph

    def supports(self, *tensors) -> bool:
        return True

    def gemm(self, x, offsets, w, zero_tail=True):
        out = x.new_zeros(x.shape[0], w.shape[1])
        for expert, rows in _expert_rows(offsets):
            out[rows] = x[rows] @ w[expert].t()
        return out

    def gemm_wgrad(self, grad, x, offsets, experts):
        result = grad.new_zeros(experts, grad.shape[1], x.shape[1])
        for expert, rows in _expert_rows(offsets):
            result[expert] = grad[rows].t() @ x[rows]
        return result

    def act(self, h, offsets, name, limit):  # computed in fp32 at least, as the kernels do
        wide = torch.promote_types(h.dtype, torch.float32)
        return ACTIVATIONS[name].torch(h.to(wide), limit).to(h.dtype)

    def act_backward(self, h, grad, offsets, name, limit):
        wide = torch.promote_types(h.dtype, torch.float32)
        spec = ACTIVATIONS[name]
        return (spec.backward(h.to(wide), grad.to(wide), limit).to(h.dtype),
                spec.torch(h.to(wide), limit).to(h.dtype))


class CudaBackend:
    """torch._grouped_mm (CUTLASS grouped GEMM, bf16, sm90+) and Triton activation kernels that also
    zero rows past offsets[-1] (the GEMM leaves them unwritten)."""

    name = "cuda"

    def supports(self, *tensors) -> bool:
        if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors):
            return False
        if not _has_grouped_gemm(tensors[0].device.index or 0):
            return False
        return all(s % 8 == 0 for t in tensors for s in t.shape[-1:])  # 16-byte rows for the GEMM

    def gemm(self, x, offsets, w, zero_tail=True):
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        return _zero_tail(out, offsets) if zero_tail else out

    def gemm_wgrad(self, grad, x, offsets, experts):
        # experts with no rows get zeros (checked: tests/test_gpu.py, zero-token experts)
        return torch._grouped_mm(grad.t(), x, offs=offsets)

    host_sync = False

    def act(self, h, offsets, name, limit):
        from ._triton_grouped_mlp import activation_forward

        return activation_forward(h, offsets, name, limit)

    def act_backward(self, h, grad, offsets, name, limit):
        from ._triton_grouped_mlp import activation_backward

        return activation_backward(h, grad, offsets, name, limit)


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
