"""What adding a weight gradient into its fp32 total costs, per GEMM shape of GPT 1b, on one GPU.

    python bench/probes/wgrad_accumulate.py --out DIR [--tokens 2048] [--microbatches 8]

A pipeline stage accumulates each microbatch's weight gradient dW = dy^T @ x (bf16, K = the
microbatch's tokens) into an fp32 total (bench/probes/grad_accumulation.py: ~40 GB of memory passes a
step on a stage of GPT 1b at pp=2, M=8). Session 28 measured Config(fuse_grad_accumulation=True)
(`aten.addmm.dtype`, fp32 C) 1.02x slower over a whole step. This times the ways to do one
accumulation, in the layouts the backward has (dy^T a transposed view, x row-major), each as the
median of CUDA-event timed repetitions:

- `mm+add`: today's default, a bf16 GEMM then one cast-and-add kernel into the total;
- `addmm.dtype`: one cuBLAS GEMM with the fp32 total as C (beta = 1), what fuse_grad_accumulation runs;
- `addmm.dtype-out`: the same written in place (`out=total`);
- `mm-fp32+add`: a GEMM with fp32 output, then an add;
- `triton`: a Triton GEMM whose epilogue loads the total, adds and stores it (fp32 all the way);
- `merged/M`: one GEMM over all M microbatches' tokens at once (K = M x tokens), divided by M: what a
  step would pay per microbatch if it computed each weight gradient once (no accumulation at all).

Then the embedding (32,000 x 2,048) of one microbatch: its dense backward (`embedding_dense_backward`,
bf16) then a cast-and-add into the fp32 total, against `fxshard::embedding_accumulate_` (the rows
added into the total in place: sorted, then a Triton kernel) and its functional form (`index_put_` with
accumulate), each also from a CUDA graph of ten calls (GPU time without the host's launches).

Writes DIR/wgrad_accumulate.json and prints a table (us per accumulation, and the sum over one
block's and the head's weights).
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = {"qkv": (6144, 2048), "proj": (2048, 2048), "gate": (5632, 2048), "up": (5632, 2048),
          "down": (2048, 5632), "head": (32000, 2048)}


def triton_kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_stages=s, num_warps=w)
               for bm, bn, bk, s, w in [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4),
                                        (256, 128, 64, 3, 8), (128, 256, 64, 4, 8), (64, 256, 64, 4, 4)]]

    @triton.autotune(configs=configs, key=["M", "N", "K"])
    @triton.jit
    def kernel(c, a, b, M, N, K, sam, sak, sbk, sbn, scm, scn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        width = GROUP * grid_n
        group = pid // width
        first_m = group * GROUP
        size_m = min(grid_m - first_m, GROUP)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            kk = k * BK + rk
            x = tl.load(a + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            y = tl.load(b + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(x, y, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        pointers = c + rm[:, None] * scm + rn[None, :] * scn
        total = tl.load(pointers, mask=mask)
        tl.store(pointers, total + acc, mask=mask)

    def run(total, a, b):
        M, K = a.shape
        N = b.shape[1]
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        kernel[grid](total, a, b, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                     total.stride(0), total.stride(1))
        return total

    return run


def embedding_rows(tokens: int, add) -> dict[str, float]:
    """us per microbatch: the dense embedding backward plus cast-and-add, against the row sums."""
    import fxshard.ops  # noqa: F401  (registers fxshard::embedding_accumulate)

    vocab, width = 32000, 2048
    indices = torch.randint(0, vocab, (1, tokens), device="cuda")
    grad = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16)
    total = torch.randn(vocab, width, device="cuda")
    dense = lambda: torch.ops.aten.embedding_dense_backward(grad, indices, vocab, -1, False)  # noqa: E731
    variants = {"dense+add": lambda: add(total, dense()), "dense alone": dense,
                "embedding_accumulate": lambda: torch.ops.fxshard.embedding_accumulate(total, grad, indices, -1),
                "embedding_accumulate_": lambda: torch.ops.fxshard.embedding_accumulate_(total, grad, indices, -1)}
    result = {name: timed(fn) for name, fn in variants.items()}
    # the same from a CUDA graph of 10 calls (no host launch time: what a captured step pays), per call
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        result[f"{name} (graphed)"] = timed(graph.replay) / 10
    return result


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    try:
        triton_accumulate = triton_kernel()
    except ImportError as error:
        triton_accumulate, why = None, str(error)
    add = torch.compile(lambda total, g: total.add_(g))
    rows = {}
    for name, (out_features, in_features) in SHAPES.items():
        dy = torch.randn(args.tokens, out_features, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, in_features, device="cuda", dtype=torch.bfloat16)
        a, b = dy.t(), x
        total = torch.randn(out_features, in_features, device="cuda")
        reference = total + (a.float() @ b.float())
        variants = {
            "mm+add": lambda: add(total, a @ b),
            "addmm.dtype": lambda: torch.ops.aten.addmm.dtype(total, a, b, torch.float32),
            "addmm.dtype-out": lambda: torch.ops.aten.addmm.dtype_out(total, a, b, torch.float32, out=total),
            "mm-fp32+add": lambda: total.add_(torch.ops.aten.mm.dtype(a, b, torch.float32)),
        }
        if triton_accumulate is not None:
            variants["triton"] = lambda: triton_accumulate(total, a, b)
        row = {}
        for variant, fn in variants.items():
            try:
                check = total.clone()
                if variant == "triton":  # autotuning runs the kernel on `total`: tune first, then check
                    fn()
                    total.copy_(check)
                result = fn() if variant != "mm+add" else None
                if variant in ("triton", "addmm.dtype-out", "mm-fp32+add"):
                    error = ((total - check) - (reference - check)).abs().max().item()  # one accumulation added
                    total.copy_(check)
                elif variant == "addmm.dtype":
                    error = (result - reference).abs().max().item()
                else:
                    error = None
                row[variant] = {"us": timed(fn), "max_abs_error": error}
                total.copy_(check)
            except Exception as failure:  # noqa: BLE001 (a variant this torch lacks: say so, go on)
                row[variant] = {"us": None, "error": f"{type(failure).__name__}: {str(failure)[:160]}"}
        dy_all = torch.randn(args.tokens * args.microbatches, out_features, device="cuda", dtype=torch.bfloat16)
        x_all = torch.randn(args.tokens * args.microbatches, in_features, device="cuda", dtype=torch.bfloat16)
        row["merged/M"] = {"us": timed(lambda: torch.ops.aten.mm.dtype(dy_all.t(), x_all, torch.float32))
                           / args.microbatches}
        row["mm alone"] = {"us": timed(lambda: a @ b)}
        rows[name] = row
        print(name, {k: (round(v["us"], 1) if v.get("us") else v.get("error")) for k, v in row.items()}, flush=True)

    variants = list(next(iter(rows.values())))
    block = [n for n in SHAPES if n != "head"]
    print(f"\n{'variant':<18}" + "".join(f"{n:>9}" for n in SHAPES) + f"{'block':>10}")
    totals = {}
    for variant in variants:
        us = [rows[n][variant].get("us") for n in SHAPES]
        blk = None if any(u is None for u in us[:len(block)]) else sum(us[:len(block)])
        totals[variant] = blk
        print(f"{variant:<18}" + "".join(f"{u:>9.1f}" if u else f"{'-':>9}" for u in us) + (f"{blk:>10.1f}" if blk else f"{'-':>10}"))
    embedding = embedding_rows(args.tokens, add)
    print("embedding", {k: round(v, 1) for k, v in embedding.items()}, flush=True)
    result = {"device": torch.cuda.get_device_name(), "embedding_us": embedding, "torch": torch.__version__, "tokens": args.tokens,
              "microbatches": args.microbatches, "rows": rows, "block_us": totals,
              "triton": None if triton_accumulate else why}
    with open(os.path.join(args.out, "wgrad_accumulate.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
