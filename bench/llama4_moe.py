"""transformers' Llama 4 MoE (or GPT-OSS, or dense Gemma 3) on one GPU: fxshard against the model's
own code.

    python bench/llama4_moe.py --out bench/llama4_moe_1xh200.json
    python bench/llama4_moe.py --model gpt-oss --out bench/gpt_oss_moe_1xh200.json
    python bench/llama4_moe.py --model gemma3 --modes fsdp2-compiled fxshard --out bench/gemma3.json
    python bench/llama4_moe.py --model gemma3 --modes fxshard --without flash_attention   # an ablation
    python bench/llama4_moe.py --device cpu --size tiny --iters 2 --out /tmp/llama4.json   # smoke test

`--model gpt-oss`: transformers' GPT-OSS (experts stored [E, in, out] with biases, its clamped
SwiGLU, attention sinks), whose experts run with transformers' default implementation ("grouped_mm"
on CUDA) in the compiled and eager modes, and which fxshard traces through the same function. Its
size: 4 layers (sliding and full attention alternating), hidden 2048, 32 heads of 64 (8 key/value
heads), 16 experts of width 2048, top-4, vocabulary 32000, 1 x 4096 tokens.

`--model gemma3`: transformers' Gemma 3 (dense), Gemma 3 4B's layer shape (hidden 2560, 8 heads of
256, 4 key/value heads, MLP width 10240, five sliding-window layers of 1024 keys to one full one): 6
layers, vocabulary 32000, 1 x 4096 tokens. In bf16 its attention traces as cuDNN's kernel with the
masks as bias tensors (passes/causal_attention.py, passes/flash_attention.py).

`--without PASS ...` takes the named passes out of fxshard's pass list for the fxshard modes (an
ablation in the same job).

transformers' `Llama4TextMoe` runs every expert over every token: one batched matmul over all E
experts, each expert's input scaled by the token's routing score, zero for the experts the token did
not choose. fxshard traces it as the sparse layer it computes (fxshard/moe_modules.py
`_llama4_text_moe`: the chosen experts only, grouped GEMMs), E / k times fewer expert FLOPs. Modes,
each from the same seed, fp32 masters, bf16 compute, AdamW, random tokens:

    compiled   the model's own forward (dense experts) under torch.compile, torch.autocast(bf16),
               torch.optim.AdamW(fused=True): what a user would run instead
    fsdp2-compiled  FSDP2 on a one-rank mesh, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
               each decoder layer under torch.compile (torchtitan's order), torch.optim.AdamW(fused=True):
               the weights themselves in bf16 for compute, where autocast leaves the experts' fp32
               (transformers' grouped_mm then falls back to a per-expert fp32 loop, a graph break)
    eager      the model's own forward without torch.compile, autocast
    fxshard    fxshard.shard on one device: Config(param_dtype=bf16), Inductor codegen, CUDA graphs
    fxshard-fused  the same with Config(fuse_grouped_mlp=True): each expert MLP as fxshard::grouped_mlp

The default size: 4 decoder layers, all MoE, hidden 2048, 16 heads of 128 (8 key/value heads), 16
experts of width 4096 (Llama 4 Scout's count and top-1), a shared expert of width 4096, vocabulary
32000, 1 x 4096 tokens. ms/step is the median over `--iters` steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import write_json  # noqa: E402

SIZES = {
    "default": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                    intermediate_size=4096, intermediate_size_mlp=4096, num_local_experts=16, num_experts_per_tok=1,
                    num_hidden_layers=4, vocab_size=32000, seq=4096),
    "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=16,
                 intermediate_size_mlp=32, num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=2,
                 vocab_size=64, seq=16),
}
GPT_OSS_SIZES = {
    "default": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    intermediate_size=2048, num_local_experts=16, num_experts_per_tok=4, num_hidden_layers=4,
                    vocab_size=32000, sliding_window=128, seq=4096),
    "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                 num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=64, sliding_window=8,
                 seq=16),
}
GEMMA3_SIZES = {
    "default": dict(hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                    intermediate_size=10240, num_hidden_layers=6, vocab_size=32000, sliding_window=1024, seq=4096),
    "tiny": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=16,
                 num_hidden_layers=2, vocab_size=64, sliding_window=8, seq=16),
}
MODELS = {"llama4": SIZES, "gpt-oss": GPT_OSS_SIZES, "gemma3": GEMMA3_SIZES}
MODES = ("compiled", "fsdp2-compiled", "eager", "fxshard", "fxshard-fused")


def build(size: str, device, model: str = "llama4"):
    import transformers

    shape = dict(MODELS[model][size])
    seq = shape.pop("seq")
    if model == "gemma3":
        layers = shape["num_hidden_layers"]
        config = transformers.Gemma3TextConfig(**shape, attention_dropout=0.0, max_position_embeddings=max(seq, 64),
                                               layer_types=["full_attention" if (i + 1) % 6 == 0 else
                                                            "sliding_attention" for i in range(layers)])
        torch.manual_seed(0)
        with torch.device(device):
            return transformers.Gemma3ForCausalLM(config), seq
    if model == "gpt-oss":
        config = transformers.GptOssConfig(**shape, attention_dropout=0.0, max_position_embeddings=max(seq, 64))
        torch.manual_seed(0)
        with torch.device(device):
            return transformers.GptOssForCausalLM(config), seq
    config = transformers.Llama4TextConfig(**shape, moe_layers=list(range(shape["num_hidden_layers"])),
                                           attention_dropout=0.0, max_position_embeddings=max(seq, 64))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Llama4ForCausalLM(config)
    return model, seq


def loss_fn(model, batch):
    logits = model(batch["idx"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt"].flatten())


def batch_for(model, seq, device):
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    return {name: torch.randint(0, vocab, (1, seq), generator=generator).to(device) for name in ("idx", "tgt")}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, warmup: int, iters: int, device) -> tuple[float, list[float]]:
    losses = []
    for _ in range(warmup):
        losses.append(float(step()))
    times = []
    for _ in range(iters):
        synchronize(device)
        started = time.perf_counter()
        loss = step()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
        losses.append(float(loss))
    return statistics.median(times), losses


def print_kernels(mode: str, step, steps: int = 3, top: int = 12) -> None:
    """The `top` CUDA kernels of `steps` steps by total time (--profile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"{mode}: top kernels over {steps} steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70))


def fsdp2(model, device):
    """`model` under FSDP2 on a one-rank mesh (a process group of this process alone, started here),
    bf16 compute and fp32 reductions, each decoder layer compiled: what a user of torchtitan's recipe
    runs on one GPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
    for layer in model.model.layers:
        layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def run(mode: str, args) -> dict:
    import fxshard

    device = torch.device(args.device)
    model, seq = build(args.size, device, args.model)
    batch = batch_for(model, seq, device)
    started = time.perf_counter()
    if mode.startswith("fxshard"):
        config = fxshard.Config(param_dtype=torch.bfloat16 if device.type == "cuda" else None,
                                cuda_graphs=device.type == "cuda", codegen="inductor",
                                fuse_grouped_mlp=mode == "fxshard-fused")
        passes = sys.modules["fxshard.passes"]
        kept = passes.PIPELINE
        passes.PIPELINE = [p for p in kept if p.name not in args.without]
        try:
            sharded = fxshard.shard(model, loss_fn, batch, optimizer=fxshard.optim.AdamW(lr=1e-4, weight_decay=0.0),
                                    config=config)
        finally:
            passes.PIPELINE = kept
        step = lambda: sharded(batch)["loss"]  # noqa: E731
        notes = sharded.program.notes.get("moe_forwards", [])[:1] + sharded.program.notes.get("fused_grouped_mlp", [])
        notes += [f"{key}: {sharded.program.notes[key]}" for key in ("causal_attention", "flash_attention")
                  if key in sharded.program.notes]
    else:
        forward = torch.compile(model) if mode == "compiled" else model
        autocast = mode != "fsdp2-compiled" and device.type == "cuda"
        if mode == "fsdp2-compiled":
            forward = fsdp2(model, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(forward, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        notes = [f"transformers experts implementation {getattr(model.config, '_experts_implementation', None)!r}, "
                 f"attention {model.config._attn_implementation!r}"]
    setup_s = time.perf_counter() - started
    ms, losses = time_steps(step, args.warmup, args.iters, device)
    if args.profile and device.type == "cuda":
        print_kernels(mode, step)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"mode": mode, "ms_per_step": ms, "tokens_per_s": seq / ms * 1e3, "setup_s": setup_s,
            "losses": losses, "peak_bytes": peak, "traced_as": notes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="llama4", choices=sorted(MODELS))
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="bench/llama4_moe.json")
    parser.add_argument("--profile", action="store_true", help="print each mode's top CUDA kernels")
    parser.add_argument("--without", nargs="*", default=[], metavar="PASS",
                        help="take these passes out of fxshard's pass list (an ablation)")
    args = parser.parse_args(argv)
    import fxshard.passes

    unknown = set(args.without) - {p.name for p in fxshard.passes.PIPELINE}
    if unknown:
        parser.error(f"--without {sorted(unknown)}: no such pass (fxshard's: "
                     f"{[p.name for p in fxshard.passes.PIPELINE]})")
    rows = []
    for mode in args.modes:
        print(f"{mode} ...", flush=True)
        try:
            rows.append(run(mode, args))
        except Exception as error:  # noqa: BLE001  one failing mode is reported, the others still run
            rows.append({"mode": mode, "error": f"{type(error).__name__}: {error}"[:2000]})
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    best = min((r["ms_per_step"] for r in rows if r.get("mode") in ("compiled", "fsdp2-compiled") and "ms_per_step" in r),
               default=None)  # the faster of the two baselines
    print("\n| mode | ms/step | tokens/s | vs best baseline | peak GiB | setup s | first / last loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['mode']} | failed: {row['error'][:200]} |")
            continue
        ratio = f"{best / row['ms_per_step']:.2f}x" if best else "-"
        peak = f"{row['peak_bytes'] / 2**30:.1f}" if row["peak_bytes"] else "-"
        print(f"| {row['mode']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:.0f} | {ratio} | {peak} | "
              f"{row['setup_s']:.1f} | {row['losses'][0]:.4f} / {row['losses'][-1]:.4f} |")
    for row in rows:
        for note in row.get("traced_as", []):
            print(f"{row['mode']}: {note}")
    write_json(args.out, model=args.model, size=args.size, shape=MODELS[args.model][args.size], warmup=args.warmup,
               iters=args.iters, without=args.without, rows=rows)


if __name__ == "__main__":
    main()
