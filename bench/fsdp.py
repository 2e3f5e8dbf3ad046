"""FSDP benchmark: one GPU without communication vs FSDP2 (fully_shard, eager) vs fxshard, side by side.

    python bench/fsdp.py --gpus 2 --batch 1 4 --model 1b --out bench/fsdp.json [--checkpoint-layers [selective]]

Every mode trains the same dense GPT (bf16 compute, fp32 master weights, fp32 gradient reduction,
AdamW) at sequence length S on per-GPU batch B and reports ms/step, tokens/s/GPU, MFU, peak memory
and the ratio to the single-GPU no-communication time of the same model and batch. Modes:

    nocomm-eager    one GPU, plain PyTorch: bf16 copy of the weights, fp32 masters, fused AdamW
    nocomm-compile  the same with torch.compile on each block (torchtitan's per-block recipe)
    nocomm-fxshard  one GPU, fxshard without a mesh, codegen by Inductor, CUDA graphs (--eager-replay: without)
    nocomm-fxshard-aten  the same without codegen (aten replay)
    nocomm-fxshard-nopointwise  nocomm-fxshard with Config(recompute_pointwise=False): the backward reads
                    every value autograd saves (passes/recompute_pointwise.py off)
    nocomm-fxshard-multiplied  nocomm-fxshard with clipping's coefficient multiplied into each gradient
                    before AdamW (a scaled fp32 copy written and read), as before AdamW took it as its
                    `grad_scale`: an A/B of that fusion, meaningful with --clip
    fsdp2           N GPUs, torch.distributed.fsdp.fully_shard per block + root, eager
    fsdp2-compile   the same with torch.compile on each block (torchtitan's recipe)
    fxshard         N GPUs, fxshard ZeRO-3 (optim_grads_params), codegen, CUDA graphs (--eager-replay: without),
                    NCCL collectives (Config(fsdp_collectives="nccl"); the default "auto" picks copy engines
                    under CUDA graphs on 2 GPUs of one host, i.e. fxshard-ce there, and NCCL elsewhere)
    fxshard-aten    the same without codegen
    fxshard-ce      fxshard with Config(fsdp_collectives="copy-engine"): all-gathers and reduce-scatters
                    moved by the copy engines (no SMs); its peak memory includes the symmetric workspace;
                    what the default gives on 2 GPUs of one host
    fxshard-ce-stream  the same with Config(copy_engine_barriers="stream"): the collectives' barriers
                    wait in stream memory operations instead of a one-block kernel (no SM at all)
    fxshard-ctasN   fxshard with Config(nccl_max_ctas=N) (its collectives on at most N SMs, fewer taken
                    from compute; slower collectives), e.g. fxshard-ctas8; fsdp2-compile-ctasN sets
                    NCCL_MAX_CTAS=N, which NCCL reads the same way
    fxshard-protoP  fxshard with NCCL_PROTO=P (Simple, LL or LL128: how NCCL's kernels move data, and
                    so what the GEMMs beside them lose), e.g. fxshard-protoSimple; suffixes combine
                    (fxshard-ctas8-protoSimple) and apply to fsdp2 modes too

A `-nodecay` suffix on a distributed mode (fxshard-nodecay, fsdp2-compile-nodecay) trains the RMSNorm
gains without weight decay: fxshard's `AdamW(no_decay=("*norm.weight",))` (their own ZeRO units),
FSDP2's a second torch.optim parameter group with weight_decay 0.

`--clip C` clips the gradient norm to C in every mode (torch.nn.utils.clip_grad_norm_ on the fp32
gradients, FSDP2's on its sharded ones; fxshard's Config(clip_grad_norm)), as most recipes do.

"vs compile" is the ratio to nocomm-compile of the same batch (the issue's yardstick). `--rounds N` runs
every mode N times in turn and adds a table of medians (the baseline moved 3% between jobs). Each fxshard
mode prints how long fxshard.shard took (trace, passes, codegen) and what codegen compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from fxshard.models.blocks import checkpointed  # noqa: E402
from common import H200_BF16_DENSE_PEAK, IDLE_SHORT_US, gemm_line, kernel_timeline, write_json  # noqa: E402


NCCL_SUFFIXES = {"-ctas": "NCCL_MAX_CTAS", "-proto": "NCCL_PROTO"}  # mode suffix -> what NCCL reads


def nccl_settings(mode: str) -> tuple[str, dict[str, str]]:
    """`mode` without its NCCL suffixes, and the environment they ask for: fxshard-ctas8-protoSimple ->
    ("fxshard", {"NCCL_MAX_CTAS": "8", "NCCL_PROTO": "Simple"})."""
    settings = {}
    for suffix, variable in NCCL_SUFFIXES.items():
        head, found, tail = mode.partition(suffix)
        if found:
            value, _, rest = tail.partition("-")
            settings[variable] = value
            mode = head + (f"-{rest}" if rest else "")
    return mode, settings


def nccl_label() -> str:
    """The NCCL suffixes of the mode this process runs (its environment), for profile file names."""
    return "".join(f"{suffix}{os.environ[variable]}" for suffix, variable in NCCL_SUFFIXES.items()
                   if os.environ.get(variable))


def flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal attention (QK^T and AV: 2*S*d per
    layer forward after the causal half, times 3 for forward and backward)."""
    d, layers, ff, vocab = cfg.d_model, cfg.n_layer, cfg.d_ff, cfg.vocab_size
    matmul_params = layers * (4 * d * d + 3 * d * ff) + d * vocab
    return 6 * matmul_params + 6 * layers * seq * d


def batch_for(cfg, batch, seq, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator).to(device),
            "tgt": torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator).to(device)}


PROFILE_DIR = os.environ.get("FXSHARD_BENCH_PROFILE")  # set by --profile DIR
CLIP = float(os.environ.get("FXSHARD_BENCH_CLIP", "0")) or None  # --clip sets it, for the spawned ranks too
CUDA_GRAPHS = os.environ.get("FXSHARD_BENCH_EAGER") != "1"  # --eager-replay sets it: fxshard modes replay the FX graph


def timed(step_fn, warmup: int, iters: int, label: str = "") -> float:
    started = time.perf_counter()
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  {warmup} warm-up steps in {time.perf_counter() - started:.1f}s", flush=True)
    started = time.perf_counter()
    for _ in range(iters):
        step_fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - started) / iters * 1e3
    if PROFILE_DIR and label:  # every rank steps (collectives), rank 0 writes
        profile(step_fn, os.path.join(PROFILE_DIR, f"{label}.txt"))
    return ms


def profile(step_fn, path, steps=2):
    """Into `path`, one file per mode (the device tool brings back 8 files a call): the kernel
    timeline as JSON on its first line (printed too: NCCL kernel time per step and how much of it ran
    with no compute kernel alongside, i.e. exposed; kernel time per step by class, `kernel_class`),
    then GPU kernel time per op over `steps` steps, the top 45 by total CUDA time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    trace = path[:-4] + ".trace.json"
    prof.export_chrome_trace(trace)
    timeline = kernel_timeline(trace, steps, lambda name: name.startswith("nccl"))
    os.remove(trace)
    with open(path, "w") as handle:
        handle.write(json.dumps(timeline) + "\n\n")
        handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))
    print(f"  {os.path.basename(path)[:-4]}: GPU busy {timeline['gpu_busy_ms']:.2f} ms/step; NCCL kernels "
          f"{timeline['comm_kernels_ms']:.2f} ms, {timeline['comm_exposed_ms']:.2f} ms of it with no other kernel "
          f"running; {timeline['kernels_per_step']:.0f} kernels; ms by class " +
          ", ".join(f"{kind} {ms:.2f}" for kind, ms in timeline["by_class_ms"].items()) +
          f"; GPU idle {timeline['idle_ms']:.2f} ms/step: {timeline['idle_short_ms']:.2f} in "
          f"{timeline['idle_short_gaps']:.0f} gaps of <= {IDLE_SHORT_US:.0f} us, {timeline['idle_long_ms']:.2f} in "
          f"{timeline['idle_long_gaps']:.0f} longer; largest (us, before, after) {timeline['idle_largest'][:3]}; "
          + gemm_line(timeline), flush=True)


def build_model(cfg, device):
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)


class CheckpointedBlock(nn.Module):
    """A block with its activation checkpoint inside, where torch.compile sees both: torchtitan applies
    activation checkpointing before it compiles each block, so the compiler's partitioner decides what
    the backward computes again (selective policies included)."""

    def __init__(self, block: nn.Module, mode):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x, cos, sin):
        return checkpointed(self.block, x, cos, sin, mode=self.mode)


def compile_blocks(model) -> None:
    """torch.compile each transformer block in place (torchtitan's per-block recipe), a checkpointed
    model's with the checkpoint inside the compiled block."""
    if model.cfg.checkpoint_layers:
        model.layers = nn.ModuleList(CheckpointedBlock(block, model.cfg.checkpoint_layers) for block in model.layers)
        model.cfg = replace(model.cfg, checkpoint_layers=False)
    for block in model.layers:
        block.compile()


def run_eager_single(cfg, batch, seq, warmup, iters, compiled=False):
    device = "cuda"
    master = build_model(cfg, device)
    low = build_model(cfg, device).to(torch.bfloat16)
    if compiled:
        compile_blocks(low)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-4, fused=True)
    data = batch_for(cfg, batch, seq, device)

    def step():
        with torch.no_grad():
            for p16, p in zip(low.parameters(), master.parameters()):
                p16.copy_(p)
        loss = low.loss(data)
        loss.backward()
        for p16, p in zip(low.parameters(), master.parameters()):
            p.grad = p16.grad.float()
            p16.grad = None
        if CLIP:
            torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP, foreach=True)
        optimizer.step()

    torch.cuda.reset_peak_memory_stats()
    label = f"nocomm-{'compile' if compiled else 'eager'}_b{batch}"
    return timed(step, warmup, iters, label), torch.cuda.max_memory_allocated()


NO_DECAY = ("*norm.weight",)  # the -nodecay modes' parameters without weight decay


def run_fxshard(cfg, batch, seq, warmup, iters, mesh=None, codegen="inductor", collectives="nccl", max_ctas=None,
                barriers="kernel", no_decay=False, pointwise=None, multiplied=False):
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    model = build_model(cfg, device)
    data = batch_for(cfg, batch, seq, device, seed=rank)
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cuda_graphs=CUDA_GRAPHS,
                            sharding="optim_grads_params", codegen=codegen, fsdp_collectives=collectives,
                            nccl_max_ctas=max_ctas, copy_engine_barriers=barriers, recompute_pointwise=pointwise,
                            clip_grad_norm=CLIP)
    started = time.perf_counter()
    optimizer = fxshard.optim.AdamW(lr=1e-4, no_decay=NO_DECAY if no_decay else ())
    takes_grad_scale = fxshard.optim.AdamW.takes_grad_scale
    if multiplied:  # the A/B: the phase multiplies each gradient before AdamW, as before the fusion
        fxshard.optim.AdamW.takes_grad_scale = lambda self, param: False
    try:
        step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=optimizer, mesh=mesh, config=config)
    finally:
        fxshard.optim.AdamW.takes_grad_scale = takes_grad_scale
    if rank == 0:
        print(f"  fxshard compiled in {time.perf_counter() - started:.1f}s: {step.program!r}; "
              f"{step.codegen.line() if step.codegen else 'no codegen'}; {step.copy_engine.line()}", flush=True)
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    label = (f"fxshard{dist.get_world_size()}" if mesh is not None else "nocomm-fxshard") + \
        f"{'' if codegen else '-aten'}{'-ce' if collectives != 'nccl' else ''}{'s' if barriers == 'stream' else ''}" \
        f"{f'-ctas{max_ctas}' if max_ctas else ''}" \
        f"{nccl_label() if mesh is not None else ''}{'-nodecay' if no_decay else ''}" \
        f"{'-nopointwise' if pointwise is False else ''}{'-multiplied' if multiplied else ''}_b{batch}"
    ms = timed(lambda: step(data), warmup, iters, label)
    from fxshard.runtime.copy_engine import workspace_bytes

    return ms, torch.cuda.max_memory_allocated() + workspace_bytes()  # symmetric memory is outside the allocator


def run_fsdp2(cfg, batch, seq, warmup, iters, compiled=False, no_decay=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank = dist.get_rank()
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    model = build_model(cfg, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if compiled:
        compile_blocks(model)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    rule = fxshard.optim.AdamW(lr=1e-4, no_decay=NO_DECAY if no_decay else ())  # which ones fxshard exempts
    named = list(model.named_parameters())
    groups = [{"params": [p for name, p in named if rule.decays(name)]},
              {"params": [p for name, p in named if not rule.decays(name)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([group for group in groups if group["params"]], lr=1e-4, fused=True)
    data = batch_for(cfg, batch, seq, device, seed=rank)

    def step():
        loss = model.loss(data)
        loss.backward()
        if CLIP:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    label = f"fsdp2{'-compile' if compiled else ''}{nccl_label()}{'-nodecay' if no_decay else ''}_{dist.get_world_size()}_b{batch}"
    return timed(step, warmup, iters, label), torch.cuda.max_memory_allocated()


def distributed_mode(mode, cfg, batch, seq, warmup, iters, max_ctas=None):
    no_decay = mode.endswith("-nodecay")
    mode = mode.removesuffix("-nodecay")
    if mode.startswith("fxshard-ce") and mode not in ("fxshard-ce", "fxshard-ce-stream"):
        raise SystemExit(f"unknown mode {mode}: the copy-engine modes are fxshard-ce and fxshard-ce-stream")
    if mode.startswith("fsdp2"):
        result = run_fsdp2(cfg, batch, seq, warmup, iters, compiled=mode == "fsdp2-compile", no_decay=no_decay)
    else:
        result = run_fxshard(cfg, batch, seq, warmup, iters, mesh=fxshard.Mesh(dp=dist.get_world_size()),
                             codegen=None if mode == "fxshard-aten" else "inductor",
                             collectives="copy-engine" if mode.startswith("fxshard-ce") else "nccl", max_ctas=max_ctas,
                             barriers="stream" if mode == "fxshard-ce-stream" else "kernel", no_decay=no_decay)
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, result)
    return max(t for t, _ in times), max(m for _, m in times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["nocomm-eager", "nocomm-compile", "nocomm-fxshard",
                                                       "nocomm-fxshard-aten", "fsdp2", "fsdp2-compile", "fxshard",
                                                       "fxshard-aten"])
    parser.add_argument("--out", default="bench/fsdp.json")
    parser.add_argument("--profile", metavar="DIR", help="after timing, write a kernel-time table per mode here")
    parser.add_argument("--eager-replay", action="store_true", help="fxshard modes without CUDA graphs")
    parser.add_argument("--checkpoint-layers", nargs="?", const="full", default=False, choices=["full", "selective"],
                        help="activation checkpointing in every mode: GPTConfig(checkpoint_layers), each block under "
                             "torch.utils.checkpoint, 'full' or 'selective' (matmul and attention outputs kept); eager "
                             "and compiled modes: PyTorch's (compiled: inside each compiled block); fxshard: its recompute pass")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this in every mode")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every mode this many times in turn and report each one's median (profiles: round 1)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.clip is not None:
        if not args.clip > 0:
            parser.error("--clip takes a norm > 0")
        os.environ["FXSHARD_BENCH_CLIP"] = str(args.clip)
        global CLIP
        CLIP = args.clip
    if args.eager_replay:
        os.environ["FXSHARD_BENCH_EAGER"] = "1"
        global CUDA_GRAPHS
        CUDA_GRAPHS = False
    if args.profile:  # the environment carries it into the spawned ranks
        os.environ["FXSHARD_BENCH_PROFILE"] = args.profile
        global PROFILE_DIR
        PROFILE_DIR = args.profile
    cfg = GPTConfig.preset(args.model, checkpoint_layers=args.checkpoint_layers)
    params = sum(p.numel() for p in build_model(cfg, "meta").parameters())
    per_token = flops_per_token(cfg, args.seq)
    rows = []
    print(f"GPT {args.model}{f' ({args.checkpoint_layers} activation checkpointing)' if args.checkpoint_layers else ''}: "
          f"{params / 1e9:.2f}B parameters, S={args.seq}{f', gradient norm clipped to {CLIP}' if CLIP else ''}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    header = (f"{'mode':<20} {'gpus':>4} {'batch':>5} {'ms/step':>9} {'tok/s/gpu':>10} {'MFU':>6} {'peak GiB':>9} "
              f"{'vs nocomm':>9} {'vs compile':>10}")
    print(header, flush=True)
    for round_index in range(args.rounds):
        if round_index == 1 and PROFILE_DIR:  # profiles come from the first round
            os.environ.pop("FXSHARD_BENCH_PROFILE", None)
            PROFILE_DIR = None
        if args.rounds > 1:
            print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for batch in args.batch:
            baseline = compiled_baseline = None
            for mode in args.modes:
                started = time.perf_counter()
                base_mode, settings = nccl_settings(mode)
                if settings and (base_mode.startswith("nocomm") or not settings.get("NCCL_MAX_CTAS", "1").isdigit()
                                 or settings.get("NCCL_PROTO", "Simple") not in ("Simple", "LL", "LL128")):
                    print(f"{mode:<20} skipped: -ctasN takes a number of SMs, -protoP one of Simple, LL, LL128, and "
                          "both a mode with communication", flush=True)
                    continue
                # fxshard takes its CTA limit as Config(nccl_max_ctas), FSDP2 from NCCL's environment
                max_ctas = int(settings.pop("NCCL_MAX_CTAS")) if base_mode.startswith("fxshard") and \
                    "NCCL_MAX_CTAS" in settings else None
                exported = {variable: os.environ.get(variable) for variable in settings}
                os.environ.update(settings)  # NCCL reads them when a communicator is made: in the ranks spawned below
                try:
                    if mode in ("nocomm-eager", "nocomm-compile"):
                        ms, peak = run_eager_single(cfg, batch, args.seq, args.warmup, args.iters,
                                                    compiled=mode == "nocomm-compile")
                        gpus = 1
                    elif mode in ("nocomm-fxshard", "nocomm-fxshard-aten", "nocomm-fxshard-nopointwise",
                                  "nocomm-fxshard-multiplied"):
                        ms, peak = run_fxshard(cfg, batch, args.seq, args.warmup, args.iters,
                                               codegen=None if mode.endswith("-aten") else "inductor",
                                               pointwise=False if mode.endswith("-nopointwise") else None,
                                               multiplied=mode.endswith("-multiplied"))
                        gpus = 1
                    else:
                        gpus = args.gpus
                        ms, peak = run_local(distributed_mode, gpus, base_mode, cfg, batch, args.seq, args.warmup,
                                             args.iters, max_ctas, backend="nccl")[0]
                except Exception as error:  # report and go on: one failing mode must not hide the others
                    print(f"{mode:<20} failed after {time.perf_counter() - started:.0f}s: "
                          f"{type(error).__name__}: {str(error)[:300]}", flush=True)
                    continue
                finally:
                    torch.cuda.empty_cache()
                    for variable, value in exported.items():
                        if value is None:
                            os.environ.pop(variable)
                        else:
                            os.environ[variable] = value
                tokens = batch * args.seq
                if mode == "nocomm-eager":  # the baseline: plain PyTorch on one GPU
                    baseline = ms
                if mode == "nocomm-compile":  # the yardstick: torch.compile on one GPU
                    compiled_baseline = ms
                mfu = per_token * tokens / (ms / 1e3) / H200_BF16_DENSE_PEAK
                row = {"mode": mode, "round": round_index, "gpus": gpus, "batch": batch, "seq": args.seq,
                       "ms_per_step": ms,
                       "tokens_per_s_per_gpu": tokens / (ms / 1e3), "mfu": mfu, "peak_bytes": peak,
                       "ratio_to_nocomm": ms / baseline if baseline else None,
                       "ratio_to_nocomm_compile": ms / compiled_baseline if compiled_baseline else None}
                rows.append(row)
                ratio = f"{row['ratio_to_nocomm']:.2f}x" if baseline else "-"
                vs_compile = f"{row['ratio_to_nocomm_compile']:.2f}x" if compiled_baseline else "-"
                print(f"{mode:<20} {gpus:>4} {batch:>5} {ms:>9.1f} {row['tokens_per_s_per_gpu']:>10.0f} "
                      f"{mfu:>6.1%} {peak / 2**30:>9.1f} {ratio:>9} {vs_compile:>10}", flush=True)
    summary = by_median(rows, per_token, args.seq) if args.rounds > 1 else []
    write_json(args.out, model=args.model, checkpoint_layers=args.checkpoint_layers, clip=CLIP, params=params, rounds=args.rounds, rows=rows, summary=summary)


def by_median(rows: list[dict], per_token: float, seq: int) -> list[dict]:
    """Each (mode, batch)'s median ms/step over the rounds, and its ratio to nocomm-compile's median of
    the same batch; printed as a table. The rounds run the modes in turn (A B A B), so a machine
    that drifts during the job moves every mode alike (bench/RESULTS.md 2026-11-28: nocomm-compile
    took 109.0-112.6 ms in four jobs on the same kind)."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["batch"]), []).append(row)
    medians = {key: statistics.median(r["ms_per_step"] for r in group) for key, group in groups.items()}
    summary = []
    print(f"\nmedian over rounds\n{'mode':<20} {'batch':>5} {'ms/step':>9} {'min':>7} {'max':>7} {'MFU':>6} "
          f"{'vs compile':>10}")
    for (mode, batch), ms in medians.items():
        times = [r["ms_per_step"] for r in groups[mode, batch]]
        compiled = medians.get(("nocomm-compile", batch))
        ratio = ms / compiled if compiled else None
        mfu = per_token * batch * seq / (ms / 1e3) / H200_BF16_DENSE_PEAK
        summary.append({"mode": mode, "batch": batch, "median_ms": ms, "min_ms": min(times), "max_ms": max(times),
                        "rounds": len(times), "mfu": mfu, "ratio_to_nocomm_compile": ratio})
        print(f"{mode:<20} {batch:>5} {ms:>9.1f} {min(times):>7.1f} {max(times):>7.1f} {mfu:>6.1%} "
              f"{f'{ratio:.3f}x' if ratio else '-':>10}", flush=True)
    return summary


if __name__ == "__main__":
    main()
