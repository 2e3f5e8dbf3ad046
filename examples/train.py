"""Main job: train a reference model with fxshard on a synthetic copy task.

Each sequence is `n` random tokens, a separator, then the same `n` tokens again; the loss counts only
the copied half, which a model can learn to predict exactly (the loss falls towards 0), while the
random half is unpredictable and ignored.

    python examples/train.py                       # MoEGPT tiny on CPU, 300 steps
    python examples/train.py --model gpt --steps 100 --dump dumps/
    python examples/train.py --dp 2                # 2 local processes (gloo on CPU, NCCL on GPU), ZeRO-3
    python examples/train.py --pp 2 --dp 2         # 4 processes: 2 pipeline stages (1F1B) x 2 data-parallel
    python examples/train.py --pp 2 --schedule dualpipev --model gpt --preset small  # 4 chunks, in a V
    python examples/train.py --dp 4 --ep 2         # 4 processes, MoE experts split over pairs of ranks
    python examples/train.py --pp 2 --dp 2 --ep 2  # 4 processes: 2 stages, each 2 ranks sharing the experts
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

import fxshard
from fxshard.config import PIPELINE_SCHEDULES
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig

MODELS = {"moe_gpt": (MoEGPT, MoEGPTConfig), "gpt": (GPT, GPTConfig)}
SEPARATOR = 0
IGNORE = -100  # F.cross_entropy's default ignore_index
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype -> Config(param_dtype)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="moe_gpt")
    parser.add_argument("--preset", default="tiny", help="model size preset: tiny, small, 1b")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--copy-len", type=int, default=8, help="tokens to copy; sequence length 2n+1")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay")
    parser.add_argument("--device", default="cpu")
    add_precision_arguments(parser)
    parser.add_argument("--dump", metavar="DIR", help="write the graph dumps here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--checkpoint-layers", nargs="?", const="full", default=False, choices=["full", "selective"],
                        help="activation checkpointing: each block under torch.utils.checkpoint, its inside "
                             "computed again in the backward (fxshard's recompute pass); 'selective' keeps the "
                             "matmuls' and attention's outputs")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (spawns local processes)")
    parser.add_argument("--sharding", default=None, choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                        help="default: optim_grads_params, or optim (ZeRO-1) with --pp > 1")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="MoE expert capacity factor (default: dropless); drops are reported per step")
    parser.add_argument("--expert-slots", action="store_true",
                        help="with --capacity-factor: MoE rows in capacity slots, expert GEMMs batched (no --ep)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel group size (divides --dp)")
    parser.add_argument("--ep-overlap", action="store_true", help="overlap MoE all-to-alls with compute: "
                        "independent work into their windows, and with --ep-microbatches 2 the two microbatches "
                        "interleaved (dual-batch); with --pp, each stage's forward/backward pairs (combined 1F1B)")
    parser.add_argument("--ep-microbatches", type=int, default=1,
                        help="with --ep > 1: gradient-accumulation microbatches per step (2: dual-batch overlap)")
    parser.add_argument("--ep-all-to-all", default="auto", choices=["auto", "nccl", "copy-engine"],
                        help="on GPUs: how EP all-to-alls move data (copy-engine: peer memcpys, no SMs held)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (multiplies the processes)")
    parser.add_argument("--schedule", default="1f1b", choices=PIPELINE_SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="gradient-accumulation microbatches per step (default: 4 with --pp > 1, else 1)")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per pipeline rank (interleaved)")
    parser.add_argument("--p2p-receives", default="late", choices=["early", "late"],
                        help="where each stage issues a point-to-point receive (Config(p2p_receives); README)")
    parser.add_argument("--p2p-ctas", type=int, default=None, metavar="N",
                        help="NCCL: the pipeline's point-to-point transfers on at most N CTAs "
                             "(Config(nccl_max_ctas={'pp': N}); README)")
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint here (every --save-every steps, and at the end); "
                        "'{step}' in DIR is replaced by the step number (keeps each one)")
    parser.add_argument("--save-every", type=int, default=0, metavar="N", help="with --save: every N steps (0: at the end)")
    parser.add_argument("--resume", metavar="DIR", help="continue from this checkpoint (any --dp/--pp/--ep may have "
                        "written it; the global batch is --batch-size x --dp)")
    return parser.parse_args(argv)


def add_precision_arguments(parser) -> None:
    """--dtype and --clip-grad-norm (this script's and train_hf.py's): `precision(args)` reads them."""
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="compute dtype (fp32 masters and gradient reduction under bf16 / fp16; fp16 scales "
                             "the loss dynamically, as torch.amp.GradScaler)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="C",
                        help="clip the gradient norm to C (Config(clip_grad_norm))")


def precision(args) -> dict:
    """The Config fields --dtype and --clip-grad-norm set."""
    compute = DTYPES[args.dtype]
    return {"param_dtype": compute, "reduce_dtype": torch.float32 if compute is not None else None,
            "clip_grad_norm": args.clip_grad_norm}


def step_log(step, index: int, metrics: dict) -> str:
    """One logged step's line: loss, gradient norm, dropped tokens and the loss scale where there are."""
    dropped = f" dropped {metrics['moe_dropped_tokens'].item()}" if "moe_dropped_tokens" in metrics else ""
    scaled = f" loss_scale {step.loss_scale:g}" if step.loss_scale is not None else ""
    skipped = " (skipped: gradients not finite)" if "skipped" in metrics and bool(metrics["skipped"]) else ""
    return f"step {index} loss {metrics['loss'].item():.4f} grad_norm {metrics['grad_norm'].item():.3f}{dropped}" \
           f"{scaled}{skipped}"


def copy_batch(generator, batch_size, copy_len, vocab_size, device):
    tokens = torch.randint(1, vocab_size, (batch_size, copy_len), generator=generator)
    separator = torch.full((batch_size, 1), SEPARATOR)
    sequence = torch.cat([tokens, separator, tokens], dim=1)
    idx, tgt = sequence[:, :-1], sequence[:, 1:].clone()
    tgt[:, :copy_len] = IGNORE  # before the separator the next token is random
    return {"idx": idx.to(device), "tgt": tgt.to(device)}


def lr_schedule(base_lr, warmup, total):
    def lr(step):
        if step <= warmup:
            return base_lr * step / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    return lr



def check_output_directory(flag: str, path: str | None, checkpoint: bool = False) -> None:
    """Before anything trains: `path` (from `flag`) names a directory this process can make or write in
    (a `{step}` in it stands for a step number); with `checkpoint`, an existing one is empty or an fxshard
    checkpoint (fxshard.save replaces nothing else). So a bad path fails now, not after training."""
    if not path:
        return
    concrete = path.replace("{step}", "1")
    if os.path.exists(concrete) and not os.path.isdir(concrete):
        raise SystemExit(f"{flag} {path} is a file; it must name a directory (new or existing)")
    existing = concrete
    while not os.path.exists(existing):  # the nearest existing ancestor is where a new directory goes
        existing = os.path.dirname(os.path.abspath(existing))
    places = [existing]
    if checkpoint and existing == concrete:  # fxshard.save writes <dir>.partial beside it, then swaps
        places.append(os.path.dirname(os.path.abspath(concrete)))
    if not all(os.access(place, os.W_OK | os.X_OK) for place in places):
        raise SystemExit(f"{flag} {path}: this process cannot write there; choose a directory it can write")
    if checkpoint and existing == concrete and os.listdir(concrete) \
            and not os.path.exists(os.path.join(concrete, "fxshard.json")):
        raise SystemExit(f"{flag} {path} exists and is not an fxshard checkpoint (no fxshard.json): choose a new "
                         f"directory, or an earlier checkpoint's, which the save replaces")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.microbatches is not None and args.pp == 1 and args.ep_microbatches > 1:
        raise SystemExit("--microbatches and --ep-microbatches both set the microbatches of a run without --pp: "
                         "give one")
    if args.microbatches is None:
        args.microbatches = 4 if args.pp > 1 else args.ep_microbatches
    if min(args.steps, args.batch_size, args.copy_len, args.dp, args.pp, args.ep, args.microbatches,
           args.ep_microbatches, args.log_every, args.virtual_stages) < 1:
        raise SystemExit("--steps, --batch-size, --copy-len, --dp, --ep, --pp, --microbatches, --ep-microbatches, "
                         "--log-every and --virtual-stages must be >= 1")
    if args.pp == 1 and (args.virtual_stages > 1 or args.schedule != "1f1b"):
        raise SystemExit("--virtual-stages and --schedule shape a pipeline: they need --pp >= 2")
    if args.ep == 1 and (args.ep_microbatches > 1 or args.ep_all_to_all != "auto"):
        raise SystemExit("--ep-microbatches and --ep-all-to-all shape expert parallelism: they need --ep >= 2 "
                         "(--microbatches splits the batch without it)")
    if args.ep_overlap and args.ep == 1 and args.pp == 1:
        raise SystemExit("--ep-overlap overlaps expert parallelism's all-to-alls: it needs --ep >= 2 (or, with "
                         "--pp, pairs each stage's forwards and backwards)")
    if args.p2p_ctas is not None and args.pp == 1:
        raise SystemExit("--p2p-ctas limits the pipeline's point-to-point transfers: it needs --pp >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA device ({torch.__version__}); "
                         f"use --device cpu")
    if args.model != "moe_gpt" and (args.capacity_factor is not None or args.expert_slots):
        raise SystemExit("--capacity-factor and --expert-slots bound MoE experts: they need --model moe_gpt")
    check_output_directory("--save", args.save, checkpoint=True)
    check_output_directory("--dump", args.dump)
    try:
        MODELS[args.model][1].preset(args.preset)
    except fxshard.FxShardError as error:
        raise SystemExit(f"--preset: {error}") from None
    if args.save_every < 0 or (args.save_every and not args.save):
        raise SystemExit("--save-every needs --save DIR and a count >= 1")
    # a save interrupted while it swapped the new checkpoint in leaves the last one as <path>.previous,
    # which fxshard.load reads
    if args.resume and not any(os.path.isdir(p) for p in (args.resume, os.path.realpath(args.resume) + ".previous")):
        raise SystemExit(f"--resume {args.resume}: no such checkpoint directory")
    if args.dp % args.ep or (args.ep > 1 and args.model != "moe_gpt"):
        raise SystemExit("--ep must divide --dp, and needs --model moe_gpt")
    if args.sharding is None:  # pipelines: ZeRO-1 (ZeRO-3 would gather each chunk again for every microbatch)
        args.sharding = "optim" if args.pp > 1 else "optim_grads_params"
    if args.dp * args.pp == 1:
        return train(args)
    # a bad mesh or pipeline cut fails here, once, before any process starts (on a meta-device model)
    with torch.device("meta"):
        model = build_model(args)
    fxshard.check(model, loss_fn(args), copy_batch(torch.Generator(), args.batch_size, args.copy_len,
                                                   model.cfg.vocab_size, "cpu"),
                  optimizer=optimizer(args), mesh=fxshard.Mesh(pp=args.pp, dp=args.dp, ep=args.ep),
                  config=step_config(args, rank=0))
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    return run_local(train, args.dp * args.pp, args, backend=backend)[-1]  # the last stage reports


def build_model(args):
    model_cls, config_cls = MODELS[args.model]
    overrides = ({"capacity_factor": args.capacity_factor, "expert_slots": args.expert_slots}
                 if args.model == "moe_gpt" else {})
    overrides["checkpoint_layers"] = args.checkpoint_layers
    return model_cls(config_cls.preset(args.preset, **overrides))


def loss_fn(args):
    return (lambda m, batch: m.loss_and_metrics(batch)) if args.model == "moe_gpt" else (lambda m, b: m.loss(b))


def optimizer(args):
    # the RMSNorm gains without weight decay, as most recipes train them
    return fxshard.optim.AdamW(lr=lr_schedule(args.lr, args.warmup, args.steps), betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, no_decay=("*norm.weight",))


def step_config(args, rank: int) -> fxshard.Config:
    # one writer per distinct program: rank 0, and under a pipeline each stage's first data-parallel rank
    writes = rank == 0 or args.pp > 1 and fxshard.Mesh(pp=args.pp, dp=args.dp, ep=args.ep).coords(rank)["dp"] == 0
    return fxshard.Config(dump_dir=args.dump if writes else None, sharding=args.sharding, schedule=args.schedule,
                          **precision(args),
                          virtual_stages=args.virtual_stages, ep_overlap=args.ep_overlap,
                          microbatches=args.microbatches,
                          ep_chunks=1, ep_interleave="combined-1f1b" if args.pp > 1 else "dual-batch",
                          ep_all_to_all=args.ep_all_to_all, p2p_receives=args.p2p_receives,
                          nccl_max_ctas={"pp": args.p2p_ctas} if args.p2p_ctas is not None else None)


def train(args) -> dict:
    """One rank's training loop; every rank draws the same global batch and keeps its data-parallel rows
    (the ranks of one pipeline keep the same rows)."""
    rank, processes = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = f"cuda:{rank}" if args.device == "cuda" and processes > 1 else args.device
    mesh = fxshard.Mesh(pp=args.pp, dp=args.dp, ep=args.ep) if processes > 1 else None
    rank_dp, world = (mesh.coords(rank)["dp"], args.dp) if mesh else (0, 1)
    say = print if rank == processes - 1 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    model = build_model(args).to(device)
    generator = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.cfg.vocab_size

    def next_batch():
        batch = copy_batch(generator, args.batch_size * world, args.copy_len, vocab, device)
        return {k: v[rank_dp * args.batch_size:(rank_dp + 1) * args.batch_size] for k, v in batch.items()}

    example = next_batch()
    say(f"model {args.model} {args.preset}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"batch {args.batch_size}x{2 * args.copy_len} per data-parallel rank, {mesh or 'one device'}, device {device}")

    started = time.perf_counter()
    step = fxshard.shard(model, loss_fn(args), example, optimizer=optimizer(args), mesh=mesh,
                         config=step_config(args, rank))
    compiled = repr(step.program) if args.pp == 1 else f"{args.schedule} pipeline, this stage's {step.program!r}"
    say(f"compiled in {time.perf_counter() - started:.1f}s: {compiled}")
    if args.dump:
        say(f"graph dumps in {args.dump} (python -m fxshard.dump {args.dump})")

    if args.resume:  # the training state, and where the data stream was
        extra = fxshard.load(step, args.resume)
        generator.set_state(extra["data_generator"])
        say(f"resumed from {args.resume} at step {step.step_count}")

    losses, pending = [], None
    started = time.perf_counter()
    for index in range(step.step_count + 1, args.steps + 1):
        metrics = step(next_batch())
        losses.append(metrics["loss"].item())
        if index % args.log_every == 0 or index == args.steps:
            say(step_log(step, index, metrics), flush=True)
        if args.save and (index == args.steps or args.save_every and index % args.save_every == 0):
            stalled = time.perf_counter()  # written in the background: the step waits for the host copy only
            directory = args.save.replace("{step}", str(index))
            pending = fxshard.save(step, directory, extra={"data_generator": generator.get_state()}, async_save=True)
            say(f"saving step {index} to {directory} (stalled {time.perf_counter() - stalled:.2f}s)")
    if pending is not None:
        pending.wait()
    if not losses:
        raise SystemExit(f"nothing to train: the checkpoint is at step {step.step_count}, --steps is {args.steps}")
    seconds = time.perf_counter() - started
    window = max(1, min(10, len(losses) // 2))  # first and last apart where the run is short
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    tokens = len(losses) * args.batch_size * world * 2 * args.copy_len
    routing = step.routing(metrics)
    if routing:  # the expert-parallel pass reports each MoE layer's routing (summed over the ranks)
        say("last step's routing: " + "; ".join(f"{layer} {what} {value.tolist()}" for layer, values in routing.items()
                                                for what, value in values.items()))
        if args.dump and rank == processes - 1:
            from fxshard.dump import dump_routing

            say(f"routing of the last step in {dump_routing(routing, args.dump)}")
    say(f"done: {len(losses)} steps in {seconds:.1f}s ({tokens / seconds:,.0f} tokens/s over {processes} process(es)); "
        f"mean loss of first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    return {"first_loss": first, "last_loss": last, "seconds": seconds, "losses": losses}


if __name__ == "__main__":
    try:
        main()
    except fxshard.FxShardError as error:  # a configuration error: its message says what to change
        raise SystemExit(f"fxshard: {error}") from None
