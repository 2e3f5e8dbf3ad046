"""fxshard::grouped_mm against a per-expert loop of plain matmuls, values and gradients."""

import torch
from hypothesis import given, strategies as st

from fxshard.ops import grouped_mm


def loop_reference(x, counts, weight):
    outs, start = [], 0
    for expert, count in enumerate(counts):
        outs.append(x[start:start + count] @ weight[expert].t())
        start += count
    return torch.cat(outs + [x.new_zeros(x.shape[0] - start, weight.shape[1])])


@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=6), d_in=st.integers(1, 6),
       d_out=st.integers(1, 6), padding=st.integers(0, 2), dtype=st.sampled_from([torch.float32, torch.float64]),
       stored_transposed=st.booleans())
def test_values_and_gradients_match_the_loop(counts, d_in, d_out, padding, dtype, stored_transposed):
    """`stored_transposed`: experts stored [E, in, out] (Llama 4, GPT-OSS) and passed transposed; their
    gradient comes out in that stored layout, contiguous, not as a transposed copy."""
    torch.manual_seed(0)
    rows = sum(counts) + padding  # rows past the last offset belong to no expert
    x = torch.randn(rows, d_in, dtype=dtype, requires_grad=True)
    shape = (len(counts), d_in, d_out) if stored_transposed else (len(counts), d_out, d_in)
    stored = torch.randn(*shape, dtype=dtype, requires_grad=True)
    weight = stored.transpose(1, 2) if stored_transposed else stored
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    grad_out = torch.randn(rows, d_out, dtype=dtype)

    out = grouped_mm(x, offsets, weight)
    grad_x, grad_w = torch.autograd.grad(out, (x, stored), grad_out)
    expected = loop_reference(x, counts, weight)
    expected_grad_x, expected_grad_w = torch.autograd.grad(expected, (x, stored), grad_out)
    assert grad_w.is_contiguous()

    tolerance = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(out, expected, **tolerance)
    assert torch.allclose(grad_x, expected_grad_x, **tolerance)
    assert torch.allclose(grad_w, expected_grad_w, **tolerance)
    for expert, count in enumerate(counts):
        if count == 0:  # an expert with no tokens gets an exactly-zero weight gradient
            assert torch.count_nonzero(grad_w[expert]) == 0


def test_gradcheck_in_double():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, w: grouped_mm(a, offsets, w), (x, weight))
    torch.library.opcheck(torch.ops.fxshard.grouped_mm.default, (x.detach(), offsets, weight.detach()))


def test_adamw_update_op_schema_and_fake():
    from fxshard.ops.adamw import adamw_update

    tensors = [torch.randn(5) for _ in range(3)] + [torch.rand(5)]
    scalars = [torch.tensor(v) for v in (0.99, 1e-2, 0.5)]
    torch.library.opcheck(torch.ops.fxshard.adamw_update.default, (*tensors, *scalars, 0.9, 0.95, 1e-8))
    assert all(o.shape == (5,) for o in adamw_update(*tensors, *scalars, 0.9, 0.95, 1e-8))
    scale = torch.tensor(0.25)
    torch.library.opcheck(torch.ops.fxshard.adamw_update.default, (*tensors, *scalars, 0.9, 0.95, 1e-8, None, scale))
    scaled = adamw_update(*tensors, *scalars, 0.9, 0.95, 1e-8, None, scale)
    multiplied = adamw_update(tensors[0], tensors[1] * scale, *tensors[2:], *scalars, 0.9, 0.95, 1e-8)
    assert all(torch.equal(a, b) for a, b in zip(scaled, multiplied))
