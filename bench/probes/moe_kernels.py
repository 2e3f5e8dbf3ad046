"""Where one GPU's MoE step goes, kernel by kernel, with the code Inductor generated for each.

    python bench/probes/moe_kernels.py --out DIR

The model and Config of `bench/moe.py --gpus 1 --ep 1 --chunks 1` (MoEGPT 4 layers, hidden 2048,
64 experts x 1024, top-8, balanced routing, S=4096, bf16 compute / fp32 masters, AdamW, CUDA graphs).
Writes DIR/kernels.txt (CUDA time per kernel over two steps) and, for each Inductor kernel among the
top 40, DIR/kernels/<name>.py: the kernel's source and the region's graph it came from.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import MoEGPT, MoEGPTConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mesh", action="store_true", help="Mesh(dp=1, ep=1), as bench/moe.py's one-GPU run "
                        "(gradients reduced in reduce_dtype as with more GPUs; without a mesh they stay bf16)")
    args = parser.parse_args()
    os.makedirs(os.path.join(args.out, "kernels"), exist_ok=True)
    cfg = MoEGPTConfig(vocab_size=32000, d_model=2048, n_layer=args.layers, n_head=16, n_expert=64, top_k=8,
                       d_ff_expert=1024, d_ff_shared=None, capacity_factor=1.0, routing="balanced")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = MoEGPT(cfg)
    generator = torch.Generator().manual_seed(0)
    data = {k: torch.randint(0, cfg.vocab_size, (1, 4096), generator=generator).cuda() for k in ("idx", "tgt")}
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="optim",
                            cuda_graphs=True, dump_dir=os.path.join(args.out, "dump"))
    step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), data, optimizer=fxshard.optim.AdamW(lr=1e-5),
                         mesh=fxshard.Mesh(dp=1, ep=1) if args.mesh else None, config=config)
    del model
    for _ in range(4):
        step(data)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(data)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90)
    with open(os.path.join(args.out, "kernels.txt"), "w") as handle:
        handle.write(table)
    print(table)
    names = [e.key for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:60]
             if e.key.startswith("triton_")]
    files = [path for r in step.codegen.regions for path in r.kernel_files] if step.codegen else []
    for name in names:
        for path in files:
            if not os.path.exists(path):
                continue
            text = open(path).read()
            start = text.find(f"def {name}(")
            if start < 0:
                continue
            begin = text.rfind("\n\n", 0, start)
            end = text.find("''', device_str=", start)
            with open(os.path.join(args.out, "kernels", f"{name}.py"), "w") as handle:
                handle.write(f"# from {path}\n" + text[max(begin, 0):end if end > 0 else start + 6000])
            break
    import shutil
    for index, path in enumerate(dict.fromkeys(files)):
        if os.path.exists(path):
            shutil.copy(path, os.path.join(args.out, "kernels", f"module_{index}.py"))
    print("kernel sources for", len(os.listdir(os.path.join(args.out, "kernels"))), "of", len(names), "triton kernels")


if __name__ == "__main__":
    sys.exit(main())
