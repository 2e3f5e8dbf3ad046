"""How much memory traffic gradient accumulation over microbatches costs a pipeline stage, counted on
CPU without running a step.

    python bench/probes/grad_accumulation.py [--microbatches 8]

Builds each stage's program of bench/pipeline.py's setup (GPT 1b, Mesh(pp=2), 1F1B, M microbatches of
1x2048, bf16 compute / fp32 master gradients) with a meta-device model and torch's FakeProcessGroup,
and counts the additions `lower_schedule` makes to accumulate each parameter's gradient (one per
parameter and microbatch after the first): how many, how many add a weight gradient that comes
straight from a matmul (cast to fp32 on the way: what Megatron's gradient-accumulation fusion folds
into the wgrad GEMM's epilogue, beta = 1 into the fp32 buffer), and the bytes each moves as a
separate pass (read the fp32 total, read the bf16 gradient, write the fp32 total; the matmul's own
bf16 write comes on top). At an assumed memory bandwidth it prints the time those passes take a step.
Not a measurement: it says how much a fused accumulation could save at most.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from fxshard.passes import run_pipeline  # noqa: E402

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


PASS_THROUGH = {aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.view.default,
                aten.t.default, aten.permute.default, aten.reshape.default}  # casts and views


def producer(node):
    """The node a value comes from, through casts and views."""
    while node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    return node


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tbps", type=float, default=3.5, help="assumed memory bandwidth, TB/s (H200: ~4.8 peak)")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fxshard import meta

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("1b"))
    one = {k: torch.zeros(1, 2048, dtype=torch.long) for k in ("idx", "tgt")}  # a microbatch: what split_stages takes
    precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    traced = fxshard.trace(model, lambda m, b: m.loss(b), one, optimizer=fxshard.optim.AdamW(lr=1e-4),
                           config=fxshard.Config(**precision))
    config = fxshard.Config(microbatches=args.microbatches, sharding="no_shard", **precision)
    for stage in range(2):
        program = run_pipeline(traced, fxshard.Mesh(pp=2), config, stage=stage)[-1]
        # lower_schedule's `accumulate`: total (of earlier microbatches) + this microbatch's gradient
        adds = [n for n in program.graph.nodes if n.op == "call_function" and n.target is aten.add.Tensor
                and all(isinstance(a, torch.fx.Node) for a in n.args[:2])
                and n.meta["val"].dtype == torch.float32
                and meta.microbatch(n.args[0]) is not None and meta.microbatch(n.args[1]) is not None
                and meta.microbatch(n.args[0]) < meta.microbatch(n.args[1])]
        from_matmul = [n for n in adds if any(producer(a).target in MATMULS for a in n.args[:2]
                                              if producer(a).op == "call_function")]
        moved = sum(n.meta["val"].numel() * (4 + 4 + 2) for n in adds)
        fused = sum(n.meta["val"].numel() * (4 + 4 + 2) for n in from_matmul)
        print(f"stage {stage}: {len(adds)} accumulating additions a step ({len(from_matmul)} of a matmul's "
              f"gradient), {moved / 1e9:.1f} GB moved as separate passes ({fused / 1e9:.1f} GB of them foldable into "
              f"the wgrad GEMM), ~{moved / (args.tbps * 1e12) * 1e3:.1f} ms a step at {args.tbps:g} TB/s", flush=True)


if __name__ == "__main__":
    main()
