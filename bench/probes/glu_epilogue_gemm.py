"""Probe (a negative result, kept so it can be rerun): SwiGLU in the epilogue of a Triton grouped GEMM.

Two persistent Triton grouped GEMMs with the activation fused into their epilogue -- fc1 + activation
(writes h and act), and fc2's data gradient + the activation's backward (reads h, writes grad_h and
act) -- timed at the grouped-MLP bench's two shapes (SwiGLU, bf16, CUDA-graph replay, median) against
what fxshard runs: torch._grouped_mm followed by the separate Triton activation pass. Each config is
checked against that path first (it came out bit-identical).

    python3 bench/probes/glu_epilogue_gemm.py

Outcome on one H200 (2026-11-23, bench/RESULTS.md): fc1 + activation 0.310 vs 0.315 ms (E=8) and 0.673-
0.716 vs 0.686 ms (E=64), within run-to-run spread; the data-gradient kernel 0.256 vs 0.240 and 0.518
vs 0.472 ms, slower. The Triton main loop is ~6% slower than CUTLASS's grouped GEMM at these shapes,
which eats what skipping the activation's separate pass saves, so fxshard's backend does not use these.
"""

import importlib.util
import os

import torch
import triton
import triton.language as tl

from fxshard.ops._triton_grouped_mlp import _CODES, _GATED, _activation

_spec = importlib.util.spec_from_file_location("parts", os.path.join(os.path.dirname(__file__), "grouped_gemm_parts.py"))
parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parts)


# Persistent kernels: one flat loop over the tiles of every expert, then of the rows past
# offsets[-1] (the "tail": outputs written as zeros, no GEMM), each program taking every
# NUM_PROGRAMS-th tile. One flat loop (not a loop over experts around a loop over their tiles) lets
# Triton's pipeliner overlap a tile's epilogue with the next tile's first loads. Within an expert the
# column tiles vary fastest, so the expert's weight stays in L2 while its row panels stream through
# once. Operands come in through TMA descriptors; a row tile that runs past its expert's last row
# reads the next expert's rows, and those results are never stored.


@triton.jit
def _group_table(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """Per group (the experts, then the tail past offsets[-1]; GROUPS a power of two > n_experts):
    (index, first row, row end, tiles)."""
    group = tl.arange(0, GROUPS)
    ends = tl.load(offsets_ptr + group, mask=group < n_experts, other=rows)
    starts = tl.load(offsets_ptr + group - 1, mask=(group > 0) & (group <= n_experts), other=0)
    starts = tl.where(group > n_experts, rows, starts)
    return group, starts, ends, tl.cdiv(ends - starts, BLOCK_M) * col_tiles


@triton.jit
def _tile_origin(tile, offsets_ptr, n_experts, rows, col_tiles, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    """(first row, row end, column tile index, is_tail, expert) of flat tile `tile`."""
    group, starts, ends, tiles = _group_table(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M, GROUPS)
    last = tl.cumsum(tiles, 0)  # one past each group's last tile
    mine = (tile >= last - tiles) & (tile < last)
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0)
    end = tl.sum(tl.where(mine, ends, 0), 0)
    is_tail = tl.sum(tl.where(mine & (group == n_experts), 1, 0), 0) > 0
    expert = tl.sum(tl.where(mine, group, 0), 0)
    local = tile - first_tile
    return start + (local // col_tiles) * BLOCK_M, end, (local % col_tiles), is_tail, expert


@triton.jit
def _total_tiles(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M: tl.constexpr, GROUPS: tl.constexpr):
    _, _, _, tiles = _group_table(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M, GROUPS)
    return tl.sum(tiles, 0)


@triton.jit
def _fc1_act_kernel(x_desc, w_desc, offsets_ptr, h_ptr, act_ptr, n_experts, rows, width, depth, limit,
                    CODE: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, STAGES: tl.constexpr,
                    GROUPS: tl.constexpr, FLATTEN: tl.constexpr):
    """h [T, H] = x[rows of e] @ w1[e].T (gate columns [0, F), linear [F, 2F) when GATED), act [T, F]
    = activation(h as stored, in bf16); width = F, depth = D. w_desc views w1 as [E * H, D]."""
    h_width = 2 * width if GATED else width
    col_tiles = tl.cdiv(width, BLOCK_N)
    total = _total_tiles(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M, GROUPS)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
        m0, end, col_tile, is_tail, expert = _tile_origin(tile, offsets_ptr, n_experts, rows, col_tiles,
                                                          BLOCK_M, GROUPS)
        n0 = col_tile * BLOCK_N
        w_row = expert * h_width + n0
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.where(is_tail, 0, depth), BLOCK_K, num_stages=STAGES):
            a = x_desc.load([m0, k])
            acc_g = tl.dot(a, w_desc.load([w_row, k]).T, acc_g)
            if GATED:
                acc_u = tl.dot(a, w_desc.load([w_row + width, k]).T, acc_u)
        r = m0 + tl.arange(0, BLOCK_M)
        c = n0 + tl.arange(0, BLOCK_N)
        mask = (r[:, None] < end) & (c[None, :] < width)
        r64 = r.to(tl.int64)
        g = acc_g.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + r64[:, None] * h_width + c[None, :], g, mask=mask)
        u = g
        if GATED:
            u = acc_u.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + r64[:, None] * h_width + width + c[None, :], u, mask=mask)
        value, _, _ = _activation(g.to(tl.float32), u.to(tl.float32), limit, CODE, GATED)
        value = tl.where(is_tail, 0.0, value)
        tl.store(act_ptr + r64[:, None] * width + c[None, :], value.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dgrad_act_kernel(g_desc, w_desc, offsets_ptr, h_ptr, grad_h_ptr, act_ptr, n_experts, rows, width, depth,
                      limit, CODE: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                      STAGES: tl.constexpr, GROUPS: tl.constexpr, FLATTEN: tl.constexpr):
    """grad_act = grad_out[rows of e] @ w2[e] (rounded to bf16, as a stored tensor would be), then the
    activation's backward at h: grad_h [T, H] and the recomputed act [T, F]; both zero past
    offsets[-1]. width = F, depth = D; w_desc views w2 as [E * D, F]."""
    h_width = 2 * width if GATED else width
    col_tiles = tl.cdiv(width, BLOCK_N)
    total = _total_tiles(offsets_ptr, n_experts, rows, col_tiles, BLOCK_M, GROUPS)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN):
        m0, end, col_tile, is_tail, expert = _tile_origin(tile, offsets_ptr, n_experts, rows, col_tiles,
                                                          BLOCK_M, GROUPS)
        n0 = col_tile * BLOCK_N
        r = m0 + tl.arange(0, BLOCK_M)
        c = n0 + tl.arange(0, BLOCK_N)
        mask = (r[:, None] < end) & (c[None, :] < width)
        r64 = r.to(tl.int64)
        live = mask & ~is_tail
        h_at = h_ptr + r64[:, None] * h_width + c[None, :]
        g = tl.load(h_at, mask=live, other=0.0)  # issued before the GEMM: in flight while it runs
        u = g
        if GATED:
            u = tl.load(h_at + width, mask=live, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.where(is_tail, 0, depth), BLOCK_K, num_stages=STAGES):
            acc = tl.dot(g_desc.load([m0, k]), w_desc.load([expert * depth + k, n0]), acc)
        grad = acc.to(grad_h_ptr.dtype.element_ty).to(tl.float32)
        value, d_g, d_u = _activation(g.to(tl.float32), u.to(tl.float32), limit, CODE, GATED)
        grad_at = grad_h_ptr + r64[:, None] * h_width + c[None, :]
        tl.store(grad_at, (grad * d_g).to(grad_h_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(grad_at + width, (grad * d_u).to(grad_h_ptr.dtype.element_ty), mask=mask)
        tl.store(act_ptr + r64[:, None] * width + c[None, :], value.to(act_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps, programs per SM); a gated forward holds two
# BLOCK_N-wide accumulators
FC1_ACT_CONFIG = (128, 128, 64, 4, 8, 1)
DGRAD_ACT_CONFIG = (128, 128, 64, 4, 8, 1)


FLATTEN = True  # tl.range(..., flatten=): measured the same as the nested loop


def _groups(experts: int) -> int:
    return triton.next_power_of_2(experts + 1)


def _programs(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fc1_act(x, offsets, w1, name, limit, config=None):
    """(h, act) for x [T, D] sorted by expert, w1 [E, H, D]: fc1 and the activation in one kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    code = _CODES[name]
    gated = code in _GATED
    experts, h_width, depth = w1.shape
    width = h_width // 2 if gated else h_width
    rows = x.shape[0]
    block_m, block_n, block_k, stages, warps, per_sm = config or FC1_ACT_CONFIG
    h = x.new_empty(rows, h_width)
    act = x.new_empty(rows, width)
    if rows and width:
        x = x.contiguous()
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w1.contiguous().view(experts * h_width, depth), [block_n, block_k])
        programs = _programs(x.device) * per_sm
        _fc1_act_kernel[(programs,)](x_desc, w_desc, offsets, h, act, experts, rows, width, depth, float(limit),
                                     CODE=code, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                     NUM_PROGRAMS=programs, STAGES=stages, GROUPS=_groups(experts),
                                     FLATTEN=FLATTEN, num_warps=warps)
    return h, act


def dgrad_act(grad_out, offsets, w2, h, name, limit, config=None):
    """(grad_h, act): fc2's data gradient and the activation's backward at h in one kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    code = _CODES[name]
    gated = code in _GATED
    experts, depth, width = w2.shape
    rows = grad_out.shape[0]
    block_m, block_n, block_k, stages, warps, per_sm = config or DGRAD_ACT_CONFIG
    grad_h = torch.empty_like(h)
    act = h.new_empty(rows, width)
    if rows and width:
        grad_out = grad_out.contiguous()
        g_desc = TensorDescriptor.from_tensor(grad_out, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w2.contiguous().view(experts * depth, width), [block_k, block_n])
        programs = _programs(grad_out.device) * per_sm
        _dgrad_act_kernel[(programs,)](g_desc, w_desc, offsets, h.contiguous(), grad_h, act, experts, rows, width,
                                       depth, float(limit), CODE=code, GATED=gated, BLOCK_M=block_m,
                                       BLOCK_N=block_n, BLOCK_K=block_k, NUM_PROGRAMS=programs, STAGES=stages,
                                       GROUPS=_groups(experts), FLATTEN=FLATTEN, num_warps=warps)
    return grad_h, act


FC1_CONFIGS = [(128, 128, 64, 4, 8, 1), (128, 128, 64, 3, 8, 1), (128, 128, 64, 2, 8, 2), (64, 128, 64, 4, 4, 2),
               (64, 128, 64, 3, 4, 2), (128, 64, 64, 3, 4, 2)]
DGRAD_CONFIGS = [(128, 128, 64, 4, 8, 1), (128, 128, 64, 3, 8, 2), (128, 128, 64, 2, 8, 2), (64, 128, 64, 4, 4, 2),
                 (128, 64, 64, 4, 4, 2), (64, 256, 64, 3, 4, 2), (128, 256, 64, 3, 8, 1), (128, 256, 64, 4, 8, 1)]


def main():
    from fxshard.ops.grouped_mlp_backends import BACKENDS

    cuda = BACKENDS["cuda"]

    class separate:  # what fxshard's CUDA backend runs
        @staticmethod
        def gemm_act(x, offs, w1, name, limit):
            h = cuda.gemm(x, offs, w1, zero_tail=False)
            return h, cuda.act(h, offs, name, limit)

        @staticmethod
        def gemm_act_backward(gy, offs, w2, h, name, limit):
            return cuda.act_backward(h, cuda.gemm(gy, offs, w2.transpose(1, 2), zero_tail=False), offs, name, limit)

    for experts, tokens, d_model, d_ff in parts.SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        choice = torch.randint(0, experts, (tokens,), device="cuda", generator=g)
        offs = torch.bincount(choice, minlength=experts).cumsum(0).to(torch.int32)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(tokens, d_model, **bf, generator=g)
        w1 = torch.randn(experts, 2 * d_ff, d_model, **bf, generator=g) * 0.02
        w2 = torch.randn(experts, d_model, d_ff, **bf, generator=g) * 0.02
        gy = torch.randn(tokens, d_model, **bf, generator=g)
        h_ref, act_ref = separate.gemm_act(x, offs, w1, "swiglu", 7.0)
        gh_ref, act2_ref = separate.gemm_act_backward(gy, offs, w2, h_ref, "swiglu", 7.0)
        flops = 2 * tokens * d_model * 2 * d_ff
        shape = f"{experts}/{tokens}/{d_model}/{d_ff}"
        base_f = parts.median_ms(lambda: separate.gemm_act(x, offs, w1, "swiglu", 7.0))
        base_b = parts.median_ms(lambda: separate.gemm_act_backward(gy, offs, w2, h_ref, "swiglu", 7.0))
        gemm_f = parts.median_ms(lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs))
        gemm_b = parts.median_ms(lambda: torch._grouped_mm(gy, w2, offs=offs))
        print(f"{shape} separate: fc1+act {base_f:.3f} ms (gemm alone {gemm_f:.3f}), "
              f"dgrad+act' {base_b:.3f} ms (gemm alone {gemm_b:.3f})", flush=True)
        n = int(offs[-1])

        def error(pairs):
            return " ".join(f"{((a[:n].float() - b[:n].float()).norm() / b[:n].float().norm()).item():.1e}"
                            for a, b in pairs)

        for config in FC1_CONFIGS:
            try:
                h, act = fc1_act(x, offs, w1, "swiglu", 7.0, config=config)
                ms = parts.median_ms(lambda: fc1_act(x, offs, w1, "swiglu", 7.0, config=config))
                print(f"{shape} fc1+act    {str(config):<26} {ms:.3f} ms ({flops / ms / 1e9:.0f} TF/s) rel err "
                      f"{error(((h, h_ref), (act, act_ref)))}", flush=True)
            except Exception as e:  # a config that does not fit (shared memory, registers)
                print(f"{shape} fc1+act    {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        for config in DGRAD_CONFIGS:
            try:
                gh, act2 = dgrad_act(gy, offs, w2, h_ref, "swiglu", 7.0, config=config)
                ms = parts.median_ms(lambda: dgrad_act(gy, offs, w2, h_ref, "swiglu", 7.0, config=config))
                print(f"{shape} dgrad+act' {str(config):<26} {ms:.3f} ms ({flops / 2 / ms / 1e9:.0f} TF/s) rel err "
                      f"{error(((gh, gh_ref), (act2, act2_ref)))}", flush=True)
            except Exception as e:
                print(f"{shape} dgrad+act' {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
