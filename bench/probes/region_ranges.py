"""Do codegen's profiler ranges attribute a step's kernels to its regions? (bench/pipeline.py's
per-action costs rest on it.) One GPU, GPT 1b cut to --layers blocks, S=2048, bf16 compute / fp32
masters, AdamW, codegen on, eager replay; one profiled step.

    python bench/probes/region_ranges.py --out DIR

Prints (and writes DIR/region_ranges.json): the regions' ranges in the trace, how many of the step's
non-communication kernels and how much of their GPU time a range launched (by correlation id; the
rest are fixed nodes: custom ops such as the fused AdamW), and the GPU time per (phase, layer).
"""

import argparse
import json
import os
import re
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from common import kernels_by_range  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402

RANGE = re.compile(r"^fxshard region_\d+ \[(\w+ \S+?)[\] ]")


def attribute(events):
    kernels = kernels_by_range(events, RANGE, lambda event: "nccl" in event.get("name", "").lower())
    per_part, missed = {}, {}
    for start, end, name, label in kernels:
        if label is None:
            missed[name[:60]] = missed.get(name[:60], 0.0) + end - start
        else:
            per_part[label] = per_part.get(label, 0.0) + end - start
    return {"kernels": len(kernels), "kernels_attributed": sum(label is not None for *_, label in kernels),
            "gpu_ms": sum(end - start for start, end, *_ in kernels) / 1e3,
            "gpu_ms_attributed": sum(per_part.values()) / 1e3,
            "ms_per_part": {k: v / 1e3 for k, v in sorted(per_part.items())},
            "ms_not_attributed_top": dict(sorted(((k, v / 1e3) for k, v in missed.items()), key=lambda kv: -kv[1])[:8])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig.preset("1b", n_layer=args.layers))
    batch = {"idx": torch.randint(0, 32000, (1, 2048), device="cuda"),
             "tgt": torch.randint(0, 32000, (1, 2048), device="cuda")}
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-4),
                         config=fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        step(batch)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as handle:
            result = attribute(json.load(handle)["traceEvents"])
    result["codegen"] = step.codegen.line() if step.codegen else None
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "region_ranges.json"), "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
