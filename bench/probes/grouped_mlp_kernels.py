"""Probe: the kernels of one grouped-MLP forward+backward, replayed from a CUDA graph and eager.

For each of the grouped-MLP bench's shapes and its `unfused` and `fused` modes: the median of single
forward+backward replays from a CUDA graph and eager (the two modes interleaved, so clock drift hits
both alike), then the per-kernel GPU time of the graphed replay (torch.profiler, averaged over
replays), largest first. Answers "where does the time go" for bench/grouped_mlp.py's numbers.

    python3 bench/probes/grouped_mlp_kernels.py [--replays 30] [--out kernels.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grouped_mlp as bench  # noqa: E402  (bench/grouped_mlp.py)


def single_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def kernel_table(replay, replays=5):
    """[(kernel name, microseconds per replay, launches per replay)], largest first."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us, count = totals.get(event.name, (0.0, 0))
            totals[event.name] = (us + event.device_time, count + 1)
    rows = [(name, us / replays, count / replays) for name, (us, count) in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


class _TwoStreams(torch.autograd.Function):
    """Experiment: fxshard's fused op, with the weight-gradient GEMMs on a side stream next to the
    rest of the backward (SIDE="wgrad": fc2's weight gradient next to fc1's; SIDE="both": both weight
    gradients next to fc1's data gradient). Each CUTLASS kernel fills the GPU; what two streams can
    win is each kernel's last, partly empty wave."""

    SIDE = "wgrad"

    @staticmethod
    def forward(ctx, x, offsets, w1, w2):
        from fxshard.ops.grouped_mlp import grouped_mlp_fwd

        out, h = grouped_mlp_fwd(x, offsets, w1, w2, None, None, "swiglu", 7.0)
        ctx.save_for_backward(x, offsets, w1, w2, h)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from fxshard.ops.grouped_mlp_backends import BACKENDS

        cuda = BACKENDS["cuda"]
        x, offsets, w1, w2, h = ctx.saved_tensors
        experts = offsets.shape[0]
        main, side = torch.cuda.current_stream(), _side_stream()
        grad_act = cuda.gemm(grad_out, offsets, w2.transpose(1, 2), zero_tail=False)
        grad_h, act = cuda.act_backward(h, grad_act, offsets, "swiglu", 7.0)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            grad_w2 = cuda.gemm_wgrad(grad_out, act, offsets, experts)
            if _TwoStreams.SIDE == "both":
                grad_w1 = cuda.gemm_wgrad(grad_h, x, offsets, experts)
        if _TwoStreams.SIDE != "both":
            grad_w1 = cuda.gemm_wgrad(grad_h, x, offsets, experts)
        grad_x = cuda.gemm(grad_h, offsets, w1.transpose(1, 2))
        main.wait_stream(side)
        for tensor in (grad_w1, grad_w2, grad_h, act, grad_out, x):
            tensor.record_stream(side)
        return grad_x, None, grad_w1, grad_w2


_SIDE = {}


def _side_stream():
    return _SIDE.setdefault(torch.cuda.current_device(), torch.cuda.Stream())


def _two_streams(side):
    def run(x, where, w1, w2):
        _TwoStreams.SIDE = side
        return _TwoStreams.apply(x, where.offsets, w1, w2)
    return run


EXPERIMENTS = {"fused-2s-wgrad": _two_streams("wgrad"), "fused-2s-both": _two_streams("both")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out")
    parser.add_argument("--layout", choices=("ragged", "capacity"), default="ragged")
    parser.add_argument("--eager-kernels", action="store_true", help="also the kernel table of an eager run")
    args = parser.parse_args()
    report = []
    for experts, tokens, d_model, d_ff in bench.SHAPES:
        x, where, w1, w2, grad = bench.problem(experts, tokens, d_model, d_ff, args.layout)
        x.requires_grad_()
        modes = {}
        for mode in ("unfused", "fused", *(EXPERIMENTS if args.layout == "ragged" else ())):
            fn = bench.MODES.get(mode) or EXPERIMENTS[mode]

            def train(fn=fn):
                torch.autograd.grad(fn(x, where, w1, w2), (x, w1, w2), grad)

            modes[mode] = (train, bench.graphed(train))
        reference = torch.autograd.grad(bench.MODES["fused"](x, where, w1, w2), (x, w1, w2), grad)
        for mode in EXPERIMENTS if args.layout == "ragged" else ():
            got = torch.autograd.grad(EXPERIMENTS[mode](x, where, w1, w2), (x, w1, w2), grad)
            print(f"{mode}: gradients bit-identical to fused: {all(torch.equal(a, b) for a, b in zip(got, reference))}")
        times = {(mode, kind): [] for mode in modes for kind in ("graphed", "eager")}
        for _ in range(args.replays):
            for mode, (train, replay) in modes.items():
                times[mode, "graphed"].append(single_ms(replay))
                times[mode, "eager"].append(single_ms(train))
        shape = f"E={experts} T={tokens} D={d_model} F={d_ff}"
        medians = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
        print(f"{shape}: median of {args.replays} single forward+backward runs (ms): " +
              ", ".join(f"{mode} {kind} {ms:.3f}" for (mode, kind), ms in medians.items()), flush=True)
        for mode in modes:
            print(f"{shape}: unfused / {mode} = {medians['unfused', 'graphed'] / medians[mode, 'graphed']:.3f} "
                  f"graphed, {medians['unfused', 'eager'] / medians[mode, 'eager']:.3f} eager", flush=True)
        for mode, (train, replay) in modes.items():
            tables = {}
            for kind, fn in (("graphed", replay), *((("eager", train),) if args.eager_kernels else ())):
                rows = tables[kind] = kernel_table(fn)
                total = sum(us for _, us, _ in rows)
                print(f"  {shape} {mode}: kernels of one {kind} run, {total:.0f} us of kernel time", flush=True)
                for name, us, count in rows:
                    print(f"    {us:8.1f} us  x{count:<4.0f} {name[:110]}", flush=True)
            report.append({"shape": [experts, tokens, d_model, d_ff], "layout": args.layout, "mode": mode,
                           "graphed_ms": medians[mode, "graphed"], "eager_ms": medians[mode, "eager"],
                           "kernels": {kind: [{"name": n, "us": us, "launches": c} for n, us, c in rows]
                                       for kind, rows in tables.items()}})
        del modes
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": report}, handle,
                      indent=1)


if __name__ == "__main__":
    main()
