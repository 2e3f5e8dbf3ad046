"""Grouped expert MLP benchmark: per-expert loop vs unfused torch._grouped_mm + eager activation vs
fxshard's fused op, forward and forward+backward, bf16, side by side in one process.

    python bench/grouped_mlp.py --out bench/grouped_mlp.json [--layouts ragged capacity]

Each shape routes T tokens to E experts at random (fixed seed; some imbalance, as in training) and
runs a SwiGLU expert MLP: fc1 [E, 2F, D], fc2 [E, D, F]. Two row layouts (fxshard.ops.grouped_mlp):
`ragged` (dropless: every token, experts' rows back to back) and `capacity` (capacity factor 1:
each expert keeps at most C = T/E of its tokens, in a C-row slot padded with zero rows, as a
capacity-based dispatch lays them out). On the capacity layout every mode gets the same slots: the
loop and the fused op compute the kept rows, torch._grouped_mm the whole slots (its groups), the
fused op runs batched GEMMs over them (`capacity=C`). Reported per mode: forward ms (eager),
forward+backward ms eager and replayed from a CUDA graph (no launch gaps: how fxshard runs a step;
TFLOP/s and the ratios use it), TFLOP/s (forward 2*rows*D*3F FLOPs over the rows experts keep, so
padding counts as waste; forward+backward 3x that), the peak memory a forward+backward adds on top
of its inputs, and what a forward keeps for its backward. The ceiling is the dense 8192^3 bf16 matmul
rate of the same GPU, replayed in turns with each shape's modes (clocks drop under sustained load,
so a rate timed from idle flatters the ceiling; that one is printed and recorded too).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fxshard.ops.grouped_mlp import grouped_mlp  # noqa: E402
from fxshard.ops.grouped_mlp_backends import BACKENDS  # noqa: E402
from common import write_json  # noqa: E402

SHAPES = [(8, 16384, 2048, 1408), (64, 65536, 2048, 768)]  # (E, T, D, F)


def cuda_time_ms(fn, warmup=3, iters=10, blocks=5) -> float:
    """ms per call: the median over `blocks` runs of `iters` back-to-back calls (one block's mean
    moved by 3-5% between runs; the median of five is steadier)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(blocks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        means.append(start.elapsed_time(end) / iters)
    return sorted(means)[len(means) // 2]


def graphed(fn):
    """`fn` captured into a CUDA graph (after warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def saved_bytes(fn) -> int:
    """Memory a forward leaves allocated for its backward (what grows with the number of layers)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out
    return held


def profile_table(fn, path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    with open(path, "w") as handle:
        handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


def peak_added_bytes(fn) -> int:
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def dense_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, warmup=5, iters=20)  # 1.4 ms a call: the same length as the MLPs
    return 2 * 8192 ** 3 / (ms / 1e3) / 1e12


class Layout:
    """Where each expert's rows are: `offsets` as fxshard's dispatch gives them (cumulative counts),
    `capacity` (None: ragged), `groups` (the offsets torch._grouped_mm gets: the counts, or the slots),
    `owned` [T] bool (rows an expert computes), `rows` (how many)."""

    def __init__(self, counts, capacity):
        experts = counts.shape[0]
        self.offsets, self.capacity = counts.cumsum(0).to(torch.int32), capacity
        if capacity is None:
            self.groups, kept = self.offsets, counts
            self.owned = torch.ones(int(counts.sum()), dtype=torch.bool, device=counts.device)
        else:
            kept = counts.clamp(max=capacity)
            self.groups = torch.arange(1, experts + 1, device=counts.device, dtype=torch.int32) * capacity
            slot_row = torch.arange(experts * capacity, device=counts.device) % capacity
            self.owned = slot_row < kept.repeat_interleave(capacity)
        self.kept = kept.tolist()
        self.rows = int(kept.sum())


def problem(experts, tokens, d_model, d_ff, layout="ragged", seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    choice = torch.randint(0, experts, (tokens,), device="cuda", generator=generator)
    where = Layout(torch.bincount(choice, minlength=experts), None if layout == "ragged" else tokens // experts)
    x = torch.randn(tokens, d_model, device="cuda", dtype=torch.bfloat16, generator=generator)
    x[~where.owned] = 0  # the capacity layout's padding rows, as a dispatch writes them
    w1 = torch.randn(experts, 2 * d_ff, d_model, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    w2 = torch.randn(experts, d_model, d_ff, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    grad = torch.randn(tokens, d_model, device="cuda", dtype=torch.bfloat16, generator=generator)
    return x, where, w1.requires_grad_(), w2.requires_grad_(), grad


def loop_mlp(x, where, w1, w2):
    outs, start = [], 0
    for expert, kept in enumerate(where.kept):
        if where.capacity is not None:
            start = expert * where.capacity
        gate, up = (x[start:start + kept] @ w1[expert].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2[expert].t())
        start += kept
    return torch.cat(outs)  # the owned rows only


def unfused_mlp(x, where, w1, w2):
    gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=where.groups).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=where.groups)


def fused_mlp(x, where, w1, w2):
    return grouped_mlp(x, where.offsets, w1, w2, activation="swiglu", capacity=where.capacity)


class _GemmsOnly(torch.autograd.Function):
    """The six GEMMs of forward+backward, as the fused op's backend runs them on this layout, and
    nothing else: the floor for the fused op (not an MLP: the activation is skipped, fc2 reads fc1's
    gate half)."""

    @staticmethod
    def forward(ctx, x, where, w1, w2):
        from fxshard.ops.grouped_mlp_backends import BACKENDS

        gemm = BACKENDS["cuda"].gemm
        h = gemm(x, where.offsets, w1, zero_tail=False, capacity=where.capacity)
        a = h[:, :w2.shape[2]].contiguous()
        ctx.save_for_backward(x, w1, w2, a)
        ctx.where = where
        return gemm(a, where.offsets, w2, zero_tail=False, capacity=where.capacity)

    @staticmethod
    def backward(ctx, grad):
        from fxshard.ops.grouped_mlp_backends import BACKENDS

        cuda, where = BACKENDS["cuda"], ctx.where
        x, w1, w2, a = ctx.saved_tensors
        experts, capacity = w1.shape[0], where.capacity
        grad_a = cuda.gemm(grad, where.offsets, w2.transpose(1, 2), zero_tail=False, capacity=capacity)
        grad_h = torch.cat([grad_a, grad_a], dim=-1)
        grad_x = cuda.gemm(grad_h, where.offsets, w1.transpose(1, 2), zero_tail=False, capacity=capacity)
        return (grad_x, None, cuda.gemm_wgrad(grad_h, x, where.offsets, experts, capacity=capacity),
                cuda.gemm_wgrad(grad, a, where.offsets, experts, capacity=capacity))


def gemms_only(x, where, w1, w2):
    return _GemmsOnly.apply(x, where, w1, w2)


MODES = {"loop": loop_mlp, "unfused": unfused_mlp, "fused": fused_mlp, "gemms-only": gemms_only}


def timed_in_turns(calls: dict, iters: int, blocks: int = 8) -> dict:
    """{name: [ms per call in each block]}, every call timed in turns, block after block: a GPU's
    clocks drop under sustained GEMM load (its power limit), by up to ~20% between runs of this
    bench, so what is compared is timed in the same stretch. The order rotates from block to block
    (whatever follows the dense matmul inherits its heat)."""
    names = list(calls)
    for call in calls.values():
        call()
    times = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names):] + names[:block % len(names)]:
            times[name].append(cuda_time_ms(calls[name], warmup=1, iters=iters, blocks=1))
    return times


def interleaved_ms(replays: dict, iters: int, blocks: int = 8) -> dict:
    """ms per call of each replay, timed in turns (timed_in_turns); median over the blocks."""
    return {name: sorted(t)[len(t) // 2] for name, t in timed_in_turns(replays, iters, blocks).items()}


def run_shape(experts, tokens, d_model, d_ff, layout, args):
    x, where, w1, w2, grad = problem(experts, tokens, d_model, d_ff, layout)
    x.requires_grad_()
    flops = 2 * where.rows * d_model * 3 * d_ff  # the rows experts keep: padding is not useful work
    outputs, rows, replays = {}, {}, {}
    for mode, fn in MODES.items():
        with torch.no_grad():
            forward_ms = cuda_time_ms(lambda: fn(x, where, w1, w2), iters=args.iters)

        def train():
            out = fn(x, where, w1, w2)
            torch.autograd.grad(out, (x, w1, w2), grad[where.owned] if mode == "loop" else grad)

        blocks = 1 if mode == "loop" else 5  # the loop is slow and far off; one block of it is enough
        train_ms = cuda_time_ms(train, iters=args.iters, blocks=blocks)
        if mode != "loop":  # the loop syncs on the host: eager only
            replays[mode] = graphed(train)
        peak = peak_added_bytes(train)
        saved = saved_bytes(lambda: fn(x, where, w1, w2))
        if args.profile and (experts, tokens, d_model, d_ff) == SHAPES[0]:
            os.makedirs(args.profile, exist_ok=True)
            profile_table(train, os.path.join(args.profile, f"{layout}-{mode}.txt"))
        out = fn(x, where, w1, w2).detach().float()
        outputs[mode] = out if mode == "loop" else out[where.owned]
        rows[mode] = {"experts": experts, "tokens": tokens, "d_model": d_model, "d_ff": d_ff, "layout": layout,
                      "capacity": where.capacity, "kept_rows": where.rows, "mode": mode,
                      "forward_ms": forward_ms, "forward_tflops": flops / forward_ms / 1e9,
                      "train_eager_ms": train_ms, "peak_bytes": peak, "saved_bytes": saved}
    # GPU time without launch gaps, as fxshard replays a step, every mode and the dense ceiling in turns
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    replays["dense"] = graphed(lambda: a @ a)
    graph_ms = interleaved_ms(replays, args.iters)
    dense = 2 * 8192 ** 3 / graph_ms.pop("dense") / 1e9
    for mode, row in rows.items():
        row["train_ms"] = graph_ms.get(mode, row["train_eager_ms"])
        row["train_tflops"] = 3 * flops / row["train_ms"] / 1e9
        row["dense_tflops"] = dense
        row["train_fraction_of_dense"] = row["train_tflops"] / dense
        print(f"{experts:>3} {tokens:>6} {d_model:>5} {d_ff:>5} {layout:<8} {mode:<10} {row['forward_ms']:>8.3f} "
              f"{row['forward_tflops']:>9.0f} {row['train_eager_ms']:>8.3f} {row['train_ms']:>8.3f} "
              f"{row['train_tflops']:>9.0f} {row['train_fraction_of_dense']:>10.1%} {row['peak_bytes'] / 2**20:>9.0f} "
              f"{row['saved_bytes'] / 2**20:>9.0f}", flush=True)
    reference = outputs["loop"]
    for mode, out in outputs.items():
        if mode == "gemms-only":
            continue
        error = (out - reference).abs().max().item() / reference.abs().max().item()
        print(f"    {mode}: max |out - loop| / max |loop| = {error:.2e}", flush=True)
    kept = f"; experts keep {where.rows} of {tokens} rows (C={where.capacity})" if where.capacity else ""
    print(f"    {layout}: dense matmul in the same stretch {dense:.0f} TFLOP/s; fused vs unfused forward+backward: "
          f"{graph_ms['unfused'] / graph_ms['fused']:.2f}x; the GEMMs alone take "
          f"{graph_ms['gemms-only'] / graph_ms['fused']:.0%} of the fused time{kept}", flush=True)
    return list(rows.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/grouped_mlp.json")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", metavar="DIR", help="kernel-time tables of forward+backward, first shape")
    parser.add_argument("--layouts", nargs="+", choices=("ragged", "capacity"), default=["ragged", "capacity"])
    args = parser.parse_args()
    assert BACKENDS["cuda"].supports(torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16)), "needs sm90+ bf16"
    ceiling = dense_rate()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: dense bf16 8192^3 matmul "
          f"{ceiling:.0f} TFLOP/s from idle (each shape's % dense uses the rate timed in turns with its modes)",
          flush=True)
    print(f"{'E':>3} {'T':>6} {'D':>5} {'F':>5} {'layout':<8} {'mode':<10} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} "
          f"{'graphed':>8} {'f+b TF/s':>9} {'f+b %dense':>10} {'peak MiB':>9} {'saved MiB':>9}", flush=True)
    rows = []
    for layout in args.layouts:
        for experts, tokens, d_model, d_ff in SHAPES:
            rows += run_shape(experts, tokens, d_model, d_ff, layout, args)
            torch.cuda.empty_cache()
    write_json(args.out, dense_tflops_from_idle=ceiling, rows=rows)


if __name__ == "__main__":
    main()
