"""What each expert-parallel all-to-all has to hide behind, estimated on CPU without running a step.

    python bench/probes/ep_windows.py [--interleave dual-batch] [--chunks 1] [--gbps 300] [--tflops 600]

Builds rank 0's program of bench/moe.py's MoEGPT (Mesh(dp=world, ep=world), 2 microbatches,
ep_overlap) with a meta-device model and torch's FakeProcessGroup (no GPU, no second process), and for
every all-to-all prints the bytes it sends to the peers and the compute between its issue and its wait
(`fxshard.graph.flops`: matmuls, attention, grouped GEMMs). With an assumed link bandwidth and an assumed
GEMM rate it estimates what stays exposed: sum over all-to-alls of max(0, transfer - window compute).
The model ignores everything but GEMM-class FLOPs and bytes, so it ranks orders, it does not predict
milliseconds; it found two interleaving defects that left windows empty (bench/RESULTS.md, 2026-11-24).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard import meta  # noqa: E402
from fxshard.graph import flops  # noqa: E402
from fxshard.models import MoEGPT, MoEGPTConfig  # noqa: E402
from fxshard.passes import run_pipeline  # noqa: E402

_c10d = torch.ops._c10d_functional


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--interleave", default="dual-batch", choices=fxshard.config.EP_INTERLEAVINGS)
    parser.add_argument("--gbps", type=float, default=300.0, help="assumed bytes/s to the peers, GB/s")
    parser.add_argument("--tflops", type=float, default=600.0, help="assumed GEMM rate, TFLOP/s")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    cfg = MoEGPTConfig(vocab_size=32000, d_model=2048, n_layer=args.layers, n_head=16, n_expert=64, top_k=8,
                       d_ff_expert=1024, d_ff_shared=None, capacity_factor=1.0, routing="balanced")
    with torch.device("meta"):
        model = MoEGPT(cfg)
    batch = {k: torch.zeros(args.microbatches, 4096, dtype=torch.long) for k in ("idx", "tgt")}
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="optim", ep_overlap=True,
                            ep_chunks=args.chunks, microbatches=args.microbatches, ep_interleave=args.interleave)
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch,
                                         optimizer=fxshard.optim.AdamW(lr=1e-5), config=config),
                           fxshard.Mesh(dp=args.world, ep=args.world), config)[-1]
    nodes = list(program.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    exposed = 0.0
    print(f"{'phase':<5} {'mb':>2} {'layer':<9} {'piece':<8} {'to peers':>9} {'transfer':>9} {'window':>10} {'compute':>9}")
    for node in nodes:
        if not meta.is_moe_all_to_all(node) or node.meta[meta.MOE_PIECE] == meta.MOE_ROUTE:
            continue
        wait = next(user for user in node.users if user.target is _c10d.wait_tensor.default)
        window = sum(flops(n) for n in nodes[position[node] + 1:position[wait]])
        sent = node.args[0].meta["val"]
        to_peers = sent.numel() * sent.element_size() * (args.world - 1) / args.world
        transfer_ms, compute_ms = to_peers / (args.gbps * 1e9) * 1e3, window / (args.tflops * 1e12) * 1e3
        exposed += max(0.0, transfer_ms - compute_ms)
        print(f"{meta.phase(node):<5} {meta.microbatch(node):>2} {meta.layer(node):<9} {node.meta[meta.MOE_PIECE]:<8} "
              f"{to_peers / 2**20:>6.0f} MiB {transfer_ms:>6.2f} ms {window / 1e12:>6.2f} TF {compute_ms:>6.2f} ms")
    print(f"estimated exposed all-to-all time: {exposed:.2f} ms a step ({args.gbps:.0f} GB/s, {args.tflops:.0f} TFLOP/s)")


if __name__ == "__main__":
    sys.exit(main())
