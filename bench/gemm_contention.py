"""What a kernel that waits on SMs costs the GEMMs beside it, and whether torch's SM carveout gives
it back. One GPU, no communication: a "spinner" kernel stands in for NCCL's point-to-point and
collective kernels, which hold their SMs from launch until the peer's data has moved (a pipeline's
receive posted early holds them for a whole backward). Its CTAs wait on the clock until told to stop,
so they use no memory bandwidth: whatever the GEMMs lose beside it is the SMs it holds.

    python bench/gemm_contention.py [--out bench/gemm_contention.json]

Two tables, each GEMM of GPT 1b's shapes (2048 tokens, d_model 2048, d_ff 5632; bf16) timed over 40
back-to-back launches on the default stream while the spinner runs on another:
  1. spinner size (CTAs x threads, dynamic shared memory) against GEMM time, cuBLAS as torch uses it;
  2. with a 16-CTA spinner, torch's SM carveout (`torch._C._set_sm_carveout_experimental(16)`) on
     cuBLAS and on cuBLASLt (`torch.backends.cuda.preferred_blas_library`).
Session 26 (2026-11-28, H200, torch 2.11 + CUDA 13): bench/RESULTS.md. Builds its spinner with
torch.utils.cpp_extension (nvcc, ~30 s the first time).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json  # noqa: E402

SPINNER_CUDA = r"""
#include <ATen/cuda/CUDAContext.h>
__global__ void spin(long long cycles, volatile int* stop) {
    extern __shared__ char reserved[];  // only held: an SM's shared memory, as NCCL's CTAs hold it
    long long start = clock64();
    while (clock64() - start < cycles) { if (stop[0] == 1) break; }
}
void launch_spin(long long cycles, torch::Tensor stop, int blocks, int threads, int smem_bytes) {
    cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    spin<<<blocks, threads, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(cycles, stop.data_ptr<int>());
}
"""
SPINNER_CPP = "void launch_spin(long long cycles, torch::Tensor stop, int blocks, int threads, int smem_bytes);"
SPINNERS = ((0, 0, 0), (1, 32, 0), (1, 640, 0), (1, 640, 160 * 1024), (2, 640, 160 * 1024), (16, 32, 0),
            (16, 640, 160 * 1024))  # NCCL's SendRecv kernel on 2 H200s: 16 CTAs of 640 threads
REPS = 40


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/gemm_contention.json")
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("fxshard_spinner", SPINNER_CPP, cuda_sources=SPINNER_CUDA, functions=["launch_spin"],
                      extra_cuda_cflags=["-O2"])
    d, ff, tokens = 2048, 5632, 2048
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(ff, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(tokens, ff, device="cuda", dtype=torch.bfloat16)
    gemms = {"fwd x@W^T": lambda: torch.mm(x, w.t()), "dgrad g@W": lambda: torch.mm(g, w),
             "wgrad g^T@x": lambda: torch.mm(g.t(), x)}
    stop = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()

    def time_gemms(spinner) -> list[float]:
        """Each GEMM's mean time in us, beside `spinner` (CTAs, threads, shared bytes) if it has CTAs."""
        blocks, threads, smem = spinner
        times = []
        for fn in gemms.values():
            torch.cuda.synchronize()
            if blocks:
                with torch.cuda.stream(side):
                    ext.launch_spin(int(4e9), stop, blocks, threads, smem)  # ~2 s at 1.98 GHz; stopped below
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPS):
                fn()
            end.record()
            end.synchronize()
            if blocks:
                stop.fill_(1)
                torch.cuda.synchronize()
                stop.zero_()
            times.append(start.elapsed_time(end) / REPS * 1e3)
        return times

    header = " ".join(f"{name:>13}" for name in gemms)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GEMM us, mean of {REPS}")
    print(f"\n{'spinner (CTAs x threads, shared)':>34} {header}")
    spinner_rows = []
    for spinner in SPINNERS:
        times = time_gemms(spinner)
        label = f"{spinner[0]} x {spinner[1]}, {spinner[2] // 1024} KiB" if spinner[0] else "none"
        spinner_rows.append({"spinner": spinner, "us": dict(zip(gemms, times))})
        print(f"{label:>34} " + " ".join(f"{t:11.1f}us" for t in times), flush=True)
    print(f"\n{'blas':>9} {'spinner':>8} {'carveout':>8} {header}")
    carveout_rows = []
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        for spinner in (SPINNERS[0], SPINNERS[-1]):
            for carveout in (None, 16):
                torch._C._set_sm_carveout_experimental(carveout)
                try:
                    times = time_gemms(spinner)
                finally:
                    torch._C._set_sm_carveout_experimental(None)
                carveout_rows.append({"blas": blas, "spinner": spinner, "carveout": carveout,
                                      "us": dict(zip(gemms, times))})
                print(f"{blas:>9} {spinner[0]:>8} {str(carveout):>8} " + " ".join(f"{t:11.1f}us" for t in times),
                      flush=True)
    write_json(args.out, shapes={"tokens": tokens, "d_model": d, "d_ff": ff}, reps=REPS, spinners=spinner_rows,
               carveouts=carveout_rows)


if __name__ == "__main__":
    main()
