"""A transformers Qwen3-MoE trained by fxshard (ep=2, overlap, CUDA graphs) and by FSDP2 eager, 2 GPUs.

    python bench/hf_moe.py --out bench/hf_moe_2xh200.json                  # 2x H200, every mode below
    python bench/hf_moe.py --device cpu --size tiny --out /tmp/hf_moe.json  # CPU smoke test (gloo)

The model is `transformers.Qwen3MoeForCausalLM` built from a `Qwen3MoeConfig` shaped like
bench/moe.py's default MoEGPT: 4 layers, hidden 2048, 16 heads of 128 (as many key/value heads:
MoEGPT's attention is multi-head), 64 experts of width 1024, top-8 with the top-k weights
renormalized (`norm_topk_prob=True`), no shared expert, vocabulary 32000, untied head, S=4096, one
sequence per GPU: 1.81B parameters, all 4 layers (none left out for memory). Qwen3 adds per-head
RMSNorms on q and k (elementwise, not counted in the FLOPs); the step FLOPs equal bench/moe.py's for
that MoEGPT with nothing dropped (18.09 TFLOP per step on 2 GPUs).
Random init by transformers under `torch.manual_seed(--seed)`, fp32 masters, on each GPU itself, so
every mode and rank starts from the same weights. No load-balancing loss (`output_router_logits`
off, transformers' default).

Loss: `model(input_ids=x, labels=x, use_cache=False).loss` (transformers' causal LM loss: labels
shifted by one inside, mean over S-1 positions) on random tokens, different on each rank, with no
attention mask: eager transformers then gives SDPA `is_causal=True` (flash attention). While fxshard
traces, transformers sees `torch.compiler.is_compiling()` and materializes the causal mask as a
tensor, so fxshard's graph calls SDPA with `attn_mask` (the kernel it ends in is printed per mode).

Modes, each in its own 2-process spawn (`fxshard.launch.run_local`), so a failing mode is reported
and the others still run:

    fsdp2-eager        torch's FSDP2: `fully_shard` per decoder layer + root, MixedPrecisionPolicy(bf16
                       params, fp32 reduce), fused torch.optim.AdamW, eager; the experts run as
                       transformers picks by default (printed: "grouped_mm" on CUDA, i.e.
                       torch's grouped GEMM on the tokens sorted by expert); every rank computes
                       all 64 experts on its own tokens (no expert parallelism)
    fxshard-ep2        fxshard, Mesh(dp=2, ep=2): passes/recognize_moe.py finds the transformers MoE
                       layers (asserted: the bench fails if any layer is not recognized) and the EP
                       pass gives each rank 32 experts, tokens moved by all-to-all (dropless: each
                       per-destination buffer holds the worst case, S*k rows, twice the balanced
                       load at ep=2), ep_overlap=True, ep_chunks=1, bf16 params / fp32 reduce,
                       fxshard's AdamW, `--sharding` (default ZeRO-3, as FSDP2), Inductor codegen,
                       the whole step replayed from one CUDA graph
    fxshard-ep2-eager  the same program replayed op by op (cuda_graphs=False)
    fxshard-dp2        fxshard, Mesh(dp=2): no expert parallelism (every rank all 64 experts, as
                       FSDP2), CUDA graphs: with the two above, splits fxshard's gain into
                       compilation and expert parallelism
    fxshard-ep2-ce     (not run unless named) fxshard-ep2 with ep_all_to_all="copy-engine"

Timing: `--warmup` steps, then `--iters` steps, each delimited by CUDA events (no host sync inside
the timed loop, so the host may run ahead as in training); ms/step is the median step of the slowest
rank; "mean" is wall time over the timed loop / iters. Peak memory: torch's max_memory_allocated
after the model was sharded, the larger rank (copy-engine workspaces are outside it).

MFU = step FLOPs / time / (2 x 989 TFLOP/s dense bf16). Step FLOPs (`step_flops`): 6 per weight a
token meets (q, k, v, o projections, router, LM head; the embedding is a lookup), plus causal
attention 6*S*(heads*head_dim) per token per layer (QK^T and AV halved by the mask, forward and
backward), plus 6 * 3 * hidden * expert_width per routed assignment. Recognized transformers layers
are dropless, so every token's top-k assignments are computed: layers * tokens * k assignments,
however unevenly the untrained router spreads them. That unevenness is reported after timing, from
one more step: the busiest expert's assignments over the mean ("expert max/mean", worst layer) and
the assignments the busier EP rank's 32 experts receive over the mean ("rank max/mean"); for
fxshard from the EP pass's `moe/<layer>/tokens_per_expert` metrics, for FSDP2 from hooks on the
routers (not available for fxshard-dp2).

`--device cpu --size tiny`: the same code on gloo, 2 processes, no CUDA graphs (fsdp2-eager and
fxshard-ep2-eager), to prove the paths; its times mean nothing.

Expected on 2x H200 (estimated, not yet measured): 15-35 GiB per GPU, 5-8 minutes for the four default modes (most of it
process start, tracing and Inductor compilation; `--modes` runs a subset). Rows print as they
complete, and the JSON is rewritten after each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from common import H200_BF16_DENSE_PEAK, write_json  # noqa: E402

WORLD = 2
SIZES = {  # Qwen3MoeConfig fields, plus the sequence length and sequences per GPU
    "default": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=16, head_dim=128, num_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=1024, seq=4096, batch=1),
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, seq=64, batch=2),
}
FXSHARD_MODES = {  # mode -> (ep, cuda_graphs, all-to-all)
    "fxshard-ep2": (2, True, "nccl"),
    "fxshard-ep2-eager": (2, False, "nccl"),
    "fxshard-dp2": (1, True, "nccl"),
    "fxshard-ep2-ce": (2, True, "copy-engine"),
}
MODES = ("fsdp2-eager", *FXSHARD_MODES)
DEFAULT_MODES = {"cuda": ["fsdp2-eager", "fxshard-ep2", "fxshard-ep2-eager", "fxshard-dp2"],
                 "cpu": ["fsdp2-eager", "fxshard-ep2-eager"]}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 1e-8, 0.1


def model_config(args) -> transformers.Qwen3MoeConfig:
    sizes = {k: v for k, v in SIZES[args.size].items() if k not in ("seq", "batch")}
    if args.layers:
        sizes["num_hidden_layers"] = args.layers
    # every layer an MoE layer (decoder_sparse_step=1, no mlp_only_layers); intermediate_size is then unused
    return transformers.Qwen3MoeConfig(**sizes, intermediate_size=4 * sizes["hidden_size"], norm_topk_prob=True,
                                       tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                                       output_router_logits=False)


def step_flops(cfg, tokens: int, seq: int) -> float:
    """Training FLOPs of one step over `tokens` tokens (all ranks) in sequences of `seq` (module docstring):
    dense weights and causal attention per token, the three expert GEMMs per routed assignment (dropless:
    all layers * tokens * top-k of them)."""
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads  # as Qwen3MoeAttention reads it
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    dense = layers * (2 * d * q_width + 2 * d * kv_width + d * cfg.num_experts) + d * cfg.vocab_size
    attention = 6 * layers * seq * q_width  # per token
    assignments = layers * tokens * cfg.num_experts_per_tok
    return (6 * dense + attention) * tokens + 6 * 3 * d * cfg.moe_intermediate_size * assignments


def sequences(args) -> tuple[int, int]:
    """(sequence length, sequences per GPU)."""
    return args.seq or SIZES[args.size]["seq"], args.batch or SIZES[args.size]["batch"]


def build_model(args, device) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(args.seed)
    with torch.device(device):
        return transformers.Qwen3MoeForCausalLM(model_config(args))


def local_batch(args, rank: int, device) -> dict:
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    seq, batch = sequences(args)
    tokens = torch.randint(0, SIZES[args.size]["vocab_size"], (batch, seq), generator=generator).to(device)
    return {"input_ids": tokens, "labels": tokens.clone()}


def loss_fn(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(step_fn, warmup: int, iters: int, device) -> tuple[list[float], float]:
    """(ms of each timed step, wall ms over the timed loop / iters), after `warmup` steps and a barrier."""
    for _ in range(warmup):
        step_fn()
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        marks[0].record()
        for mark in marks[1:]:
            step_fn()
            mark.record()
        synchronize(device)
        times = [start.elapsed_time(end) for start, end in zip(marks, marks[1:])]
    else:
        times, last = [], started
        for _ in range(iters):
            step_fn()
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
    return times, (time.perf_counter() - started) * 1e3 / iters


def routing_spread(counts: torch.Tensor) -> dict:
    """counts [layers, experts] of assignments (all ranks): the busiest expert and the busier EP rank
    (consecutive blocks of E/2 experts), each over the mean, worst layer."""
    counts = counts.double()
    per_rank = counts.view(counts.shape[0], WORLD, -1).sum(-1)
    return {"expert_max_over_mean": (counts.max(1).values / counts.mean(1)).max().item(),
            "rank_max_over_mean": (per_rank.max(1).values / per_rank.mean(1)).max().item(),
            "assignments": int(counts.sum().item())}


def fsdp2_step(model, args, device):
    """FSDP2 over the world: the step, a function running one more step that returns its loss (mean over
    ranks) and routing spread (hooks on the routers), and {}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=args.param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # fused on CUDA (bench/fsdp.py's baseline); torch's default (foreach) on CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=device.type == "cuda")
    batch = local_batch(args, dist.get_rank(), device)

    def step():
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def last_step():
        experts = model.config.num_experts
        counts = []
        hooks = [layer.mlp.gate.register_forward_hook(  # the router returns (logits, weights, expert ids)
            lambda module, inputs, output: counts.append(torch.bincount(output[2].reshape(-1), minlength=experts)))
            for layer in model.model.layers]
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for hook in hooks:
            hook.remove()
        total = torch.stack(counts)
        dist.all_reduce(total)
        loss = loss.detach().float()
        dist.all_reduce(loss)  # fxshard's metric: the mean of the ranks' losses
        return loss.item() / WORLD, routing_spread(total.cpu())

    return step, last_step, {}


def fxshard_step(model, args, device, mode):
    """The sharded step (the model itself is not kept), a function running one more step that returns its
    loss (mean over ranks) and routing spread, and what shard() reported."""
    ep, cuda_graphs, all_to_all = FXSHARD_MODES[mode]
    rank, layers = dist.get_rank(), model.config.num_hidden_layers
    config = fxshard.Config(param_dtype=args.param_dtype, reduce_dtype=torch.float32, sharding=args.sharding,
                            cuda_graphs=cuda_graphs, ep_overlap=ep > 1, ep_chunks=1, ep_all_to_all=all_to_all,
                            ep_sm_carveout=args.sm_carveout if ep > 1 and all_to_all == "nccl" else None,
                            microbatches=args.microbatches, ep_interleave=args.interleave,
                            fuse_grouped_mlp=args.fuse_grouped_mlp)
    optimizer = fxshard.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    batch = local_batch(args, rank, device)
    started = time.perf_counter()
    step = fxshard.shard(model, loss_fn, batch, optimizer=optimizer, mesh=fxshard.Mesh(dp=WORLD, ep=ep), config=config)
    info = {"compile_s": time.perf_counter() - started, "attention": attention_ops(step.program)}
    if ep > 1:
        info["moe_recognized"] = check_recognized(step, layers)
    if rank == 0:
        print(f"  {mode}: fxshard.shard in {info['compile_s']:.1f}s: {step.program!r}; "
              f"{step.codegen.line() if step.codegen else 'no codegen'}\n  attention in the graph: {info['attention']}",
              flush=True)
        if ep > 1:
            print("  recognized: " + "; ".join(info["moe_recognized"]), flush=True)
            print("  " + step.program.notes["ep"].replace("\n", "\n  "), flush=True)

    def last_step():
        metrics = step(batch)
        if ep == 1:  # no EP pass, no routing metrics
            return metrics["loss"].item(), None
        routing = step.routing(metrics)  # summed over ranks
        counts = [routing[f"model.layers.{i}"]["tokens_per_expert"] for i in range(layers)]
        return metrics["loss"].item(), routing_spread(torch.stack(counts).cpu())

    return lambda: step(batch), last_step, info


def check_recognized(step, layers: int) -> list[str]:
    """passes/recognize_moe.py's notes: every decoder layer's MoE must be recognized, and the final program
    must move tokens by all-to-all; else this mode would not be expert-parallel, and fails here."""
    recognize = next((p for p in step.programs if p.name == "recognize_moe"), None)
    if recognize is None:
        raise RuntimeError("no recognize_moe program among the step's programs: the MoE layers were not looked for")
    found = {line.split(" ")[0] for line in recognize.notes.get("moe_recognized", [])}
    expected = {f"model.layers.{i}" for i in range(layers)}
    if found != expected or recognize.notes.get("moe_unrecognized"):
        raise RuntimeError(f"transformers' MoE layers not all recognized: found {sorted(found)}, expected "
                           f"{sorted(expected)}; unrecognized: {recognize.notes.get('moe_unrecognized')}")
    if not any(n.target is torch.ops._c10d_functional.all_to_all_single.default for n in step.program.graph.nodes):
        raise RuntimeError("the MoE layers were recognized but the final program has no all-to-all")
    return recognize.notes["moe_recognized"]


def attention_ops(program) -> str:
    """The SDPA kernels the graph calls, and whether they get a mask."""
    found = {}
    for node in program.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and "attention" in name and "backward" not in name:
            masked = isinstance(node.kwargs.get("attn_mask"), torch.fx.Node) or \
                any(isinstance(a, torch.fx.Node) for a in node.args[3:4])
            key = f"{name.removeprefix('aten.').removesuffix('.default')}{' with attn_mask' if masked else ''}"
            found[key] = found.get(key, 0) + 1
    return ", ".join(f"{count} x {key}" for key, count in found.items()) or "none found"


def run_mode(mode: str, args) -> dict:
    """In each of the WORLD processes: build, shard, time, measure routing; every rank returns the same row."""
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    model = build_model(args, device)
    if rank == 0:
        print(f"  {mode}: transformers experts implementation {model.config._experts_implementation!r}, attention "
              f"{model.config._attn_implementation!r}, parameters {next(model.parameters()).dtype}", flush=True)
    started = time.perf_counter()
    if mode == "fsdp2-eager":
        step, last_step, info = fsdp2_step(model, args, device)
        info["compile_s"] = time.perf_counter() - started
    else:
        step, last_step, info = fxshard_step(model, args, device, mode)
        del model  # fxshard holds its own state
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times, mean_ms = step_times(step, args.warmup, args.iters, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    loss, spread = last_step()
    mine = {"median_ms": statistics.median(times), "mean_ms": mean_ms, "peak_bytes": peak}
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    return {"mode": mode, "ms_per_step": max(r["median_ms"] for r in every),
            "median_ms_per_rank": [r["median_ms"] for r in every], "mean_ms": max(r["mean_ms"] for r in every),
            "peak_bytes": max(r["peak_bytes"] for r in every) if peak is not None else None,
            "loss_after": loss, "routing": spread, **info}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, for a smoke test")
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--layers", type=int, help="override the size's number of decoder layers")
    parser.add_argument("--seq", type=int, help="override the size's sequence length")
    parser.add_argument("--batch", type=int, help="override the size's sequences per GPU")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        help=f"default: {' '.join(DEFAULT_MODES['cuda'])} (CPU: {' '.join(DEFAULT_MODES['cpu'])})")
    parser.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"],
                        help="compute dtype of both systems (masters stay fp32; gradients reduced in fp32)")
    parser.add_argument("--sharding", default="optim_grads_params", choices=fxshard.config.SHARDING_STRATEGIES,
                        help="fxshard's Config(sharding); the default, ZeRO-3, is FSDP2's; bench/moe.py uses optim")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="fxshard modes: split each GPU's --batch sequences into this many microbatches "
                             "(FSDP2 runs them as one batch); with > 1, ep_interleave alternates them")
    parser.add_argument("--interleave", default="dual-batch", choices=fxshard.config.EP_INTERLEAVINGS)
    parser.add_argument("--sm-carveout", type=int, default=None, help="fxshard NCCL ep modes: Config(ep_sm_carveout)")
    parser.add_argument("--fuse-grouped-mlp", action="store_true", help="fxshard modes: Config(fuse_grouped_mlp=True)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/hf_moe.json")
    args = parser.parse_args(argv)
    args.param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.param_dtype]
    args.modes = args.modes or DEFAULT_MODES[args.device]
    graphed = [m for m in args.modes if m in FXSHARD_MODES and FXSHARD_MODES[m][1]]
    if args.device == "cpu" and graphed:
        parser.error(f"{graphed} replay CUDA graphs: not on --device cpu")
    return args


def print_row(row: dict) -> None:
    spread = row["routing"] or {}
    memory = f"{row['peak_bytes'] / 2**30:.1f}" if row["peak_bytes"] is not None else "-"
    expert = f"{spread['expert_max_over_mean']:.2f}" if spread else "-"
    rank = f"{spread['rank_max_over_mean']:.3f}" if spread else "-"
    print(f"{row['mode']:<18} {row['ms_per_step']:>9.2f} {row['mean_ms']:>9.2f} {row['mfu']:>6.1%} {memory:>9} "
          f"{expert:>16} {rank:>14} {row['loss_after']:>7.3f} {row['compile_s']:>8.1f}   "
          f"({row['wall_s']:.0f}s with process start)", flush=True)


def main(argv=None):
    args = parse_args(argv)
    cfg = model_config(args)
    seq, batch = sequences(args)
    if batch % args.microbatches:
        raise SystemExit(f"--batch {batch} is not divisible by --microbatches {args.microbatches}")
    tokens = WORLD * batch * seq
    flops = step_flops(cfg, tokens, seq)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.Qwen3MoeForCausalLM(cfg).parameters())
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    peak = H200_BF16_DENSE_PEAK
    assignments = cfg.num_hidden_layers * tokens * cfg.num_experts_per_tok
    print(f"Qwen3MoeForCausalLM ({args.size}): {params / 1e6:,.1f}M parameters, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, {cfg.num_experts} experts x "
          f"{cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}, S={seq} x {batch} per GPU, {WORLD} x "
          f"{device_name}, {args.param_dtype} compute, torch {torch.__version__}, transformers "
          f"{transformers.__version__}\n{flops / 1e12:.4g} TFLOP per step (dropless: {assignments} assignments); "
          f"MFU against {WORLD} x {peak / 1e12:.0f} TFLOP/s", flush=True)
    header = (f"{'mode':<18} {'ms/step':>9} {'mean ms':>9} {'MFU':>6} {'peak GiB':>9} {'expert max/mean':>16} "
              f"{'rank max/mean':>14} {'loss':>7} {'setup s':>8}")
    rows = []
    print(header, flush=True)
    for mode in args.modes:
        started = time.perf_counter()
        try:
            row = run_local(run_mode, WORLD, mode, args, backend="nccl" if args.device == "cuda" else "gloo")[0]
        except Exception as error:  # report and go on: one failing mode must not hide the others
            failure = f"{type(error).__name__}: {str(error)[-1500:]}"
            print(f"{mode:<18} failed after {time.perf_counter() - started:.0f}s: {failure}", flush=True)
            rows.append({"mode": mode, "failed": failure})
        else:
            row.update(mfu=flops / (row["ms_per_step"] / 1e3) / (WORLD * peak), wall_s=time.perf_counter() - started)
            rows.append(row)
            print_row(row)
        write_json(args.out, args={k: str(v) for k, v in vars(args).items()}, model=cfg.to_dict(), params=params,
                   tokens_per_step=tokens, flops_per_step=flops, peak_flops_per_gpu=peak, rows=rows)
    print("ms/step: median step, slowest rank; mean: wall time / iters; setup: fully_shard or fxshard.shard; "
          "expert/rank max/mean: routing spread (worst layer)\nand loss (mean over ranks) of one step after timing")
    return rows


if __name__ == "__main__":
    main()
