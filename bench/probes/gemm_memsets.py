"""Which of GPT 1b's GEMMs (1x2048 tokens, bf16) launch a memset next to the GEMM, and what each
costs, under each BLAS library torch can call: the pipeline's kernel census
(bench/probes/pipeline_fake_stages.py) found ~800 `Memset (Device)` a step on stage 0, each before a
cuBLAS nvjet GEMM, and each a launch of its own (~1.7 us of gap even in a CUDA graph).

    python bench/probes/gemm_memsets.py

Prints per GEMM and library: memsets per call, kernels per call, us per call (CUDA events, 200 calls);
also with `allow_bf16_reduced_precision_reduction = False` ("no-rpr"). The environment's cuBLAS
workspace settings (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE) apply as set.
"""

import torch

TOKENS, D, FF = 2048, 2048, 5632


def gemms():
    dev, dt = "cuda", torch.bfloat16
    x, h = torch.randn(TOKENS, D, device=dev, dtype=dt), torch.randn(TOKENS, FF, device=dev, dtype=dt)
    wqkv, wo = torch.randn(3 * D, D, device=dev, dtype=dt), torch.randn(D, D, device=dev, dtype=dt)
    w1, w2 = torch.randn(FF, D, device=dev, dtype=dt), torch.randn(D, FF, device=dev, dtype=dt)
    gqkv, gff = torch.randn(TOKENS, 3 * D, device=dev, dtype=dt), torch.randn(TOKENS, FF, device=dev, dtype=dt)
    acc_qkv = torch.zeros(3 * D, D, device=dev, dtype=torch.float32)
    return {
        "fwd qkv x@Wqkv^T": lambda: torch.mm(x, wqkv.t()),
        "fwd o x@Wo^T": lambda: torch.mm(x, wo.t()),
        "fwd w1 x@W1^T": lambda: torch.mm(x, w1.t()),
        "fwd w2 h@W2^T": lambda: torch.mm(h, w2.t()),
        "dgrad qkv g@Wqkv": lambda: torch.mm(gqkv, wqkv),
        "dgrad w1 g@W1": lambda: torch.mm(gff, w1),
        "wgrad qkv g^T@x": lambda: torch.mm(gqkv.t(), x),
        "wgrad qkv g^T@x fp32 out": lambda: torch.mm(gqkv.t(), x, out_dtype=torch.float32),
        "wgrad qkv accumulate fp32": lambda: torch.ops.fxshard.matmul_accumulate_(acc_qkv, gqkv.t(), x),
    }


def census(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    memsets = sum("memset" in e.name.lower() for e in events)
    names = sorted({e.name[:60] for e in events if "memset" not in e.name.lower()})
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        fn()
    end.record()
    torch.cuda.synchronize()
    return memsets / 10, len(events) / 10, start.elapsed_time(end) / 200 * 1e3, names


def main():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    import fxshard  # noqa: F401  (registers fxshard::matmul_accumulate_)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUBLAS_WORKSPACE_CONFIG="
          f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE')}")
    print(f"{'GEMM':<28} {'library':<15} {'memsets/call':>12} {'kernels/call':>12} {'us/call':>8}  kernels")
    variants = [("cublas", True), ("cublaslt", True), ("cublas", False)]
    for library, reduced in variants:
        torch.backends.cuda.preferred_blas_library(library)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        if not reduced:
            library += ",no-rpr"  # no reduced-precision (split-K) reductions of bf16 products
        for name, fn in gemms().items():
            try:
                memsets, kernels, us, names = census(fn)
            except Exception as error:  # noqa: BLE001 -- a probe: say what failed and go on
                print(f"{name:<28} {library:<15} failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            print(f"{name:<28} {library:<15} {memsets:>12.1f} {kernels:>12.1f} {us:>8.1f}  {'; '.join(names)}")


if __name__ == "__main__":
    main()
