"""Train a Hugging Face transformers causal LM with fxshard: the copy task of examples/train.py, in
rows of different lengths, right-padded, with attention masks.

The model is built from a config (nothing is downloaded): a Llama-like dense model or a
Qwen3-MoE-like one, randomly initialized, or from `--weights DIR`: what `--save DIR` or
`save_pretrained` wrote (read by transformers, which knows its own layout: MoE experts are saved one
by one), or safetensors in the model's own names (read by `fxshard.load_hf`). The loss is the model's own
(`model(input_ids, attention_mask, labels, use_cache=False).loss`).

    python examples/train_hf.py                            # Llama-like, one process, CPU
    python examples/train_hf.py --arch qwen3_moe --dp 2    # MoE, 2 processes, ZeRO-3
    python examples/train_hf.py --arch qwen3_moe --dp 2 --ep 2   # the experts split over the 2 ranks
    python examples/train_hf.py --arch gpt_oss --steps 100  # GPT-OSS: attention with sinks, biased experts
    python examples/train_hf.py --pp 2 --dp 2              # 4 processes: 2 stages x 2 data-parallel
    python examples/train_hf.py --save hf_out && python examples/train_hf.py --weights hf_out --steps 20

`--ep` splits the experts: fxshard recognizes transformers' MoE layers in the traced graph
(passes/recognize_moe.py) and moves their tokens by all-to-all (`--dump DIR` shows both).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import add_precision_arguments, check_output_directory, lr_schedule, precision, step_log  # noqa: E402
# (the same schedule, checks, precision flags and log line)

PAD, SEPARATOR, IGNORE = 0, 1, -100
VOCAB = 64
ARCHITECTURES = {  # tiny presets: CPU-sized, the shapes of the real ones
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                       num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",  # sliding and full attention with sinks, biased experts
                dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=8)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--weights", metavar="DIR", help="initialize from DIR: what save_pretrained wrote (with its "
                                                         "config.json), or safetensors in the model's own names")
    parser.add_argument("--save", metavar="DIR", help="at the end, save_pretrained the trained model here")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank per step")
    parser.add_argument("--copy-len", type=int, default=8, help="longest copy; each row copies 2..n tokens")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches (with --pp > 1)")
    parser.add_argument("--dump", metavar="DIR", help="write the graph dumps here")
    add_precision_arguments(parser)
    return parser.parse_args(argv)


def build_model(args):
    import transformers

    config_name, model_name, sizes = ARCHITECTURES[args.arch]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, pad_token_id=PAD, **sizes)
    return getattr(transformers, model_name)(config)


def copy_batch(generator, rows: int, copy_len: int, device) -> dict:
    """Rows `t_1..t_k SEP t_1..t_k PAD...` with k drawn per row; labels only on the copied half."""
    length = 2 * copy_len + 1
    input_ids = torch.full((rows, length), PAD)
    labels = torch.full((rows, length), IGNORE)
    mask = torch.zeros(rows, length, dtype=torch.long)
    for row, k in enumerate(torch.randint(2, copy_len + 1, (rows,), generator=generator).tolist()):
        tokens = torch.randint(2, VOCAB, (k,), generator=generator)
        input_ids[row, :2 * k + 1] = torch.cat([tokens, torch.tensor([SEPARATOR]), tokens])
        labels[row, k + 1:2 * k + 1] = tokens  # the model shifts labels by one itself
        mask[row, :2 * k + 1] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def loss_fn(model, batch):
    return model(**batch, use_cache=False).loss


def optimizer(args):
    # the norm gains (input_layernorm, q_norm, ...) without weight decay, as most recipes train them;
    # these architectures have no biases
    return fxshard.optim.AdamW(lr=lr_schedule(args.lr, args.warmup, args.steps), betas=(0.9, 0.95), weight_decay=0.1,
                               no_decay=("*norm.weight",))


def mesh_of(args):
    return fxshard.Mesh(pp=args.pp, dp=args.dp, ep=args.ep)


def config_of(args, rank: int) -> fxshard.Config:
    writes = rank == 0 or args.pp > 1 and mesh_of(args).coords(rank)["dp"] == 0
    return fxshard.Config(dump_dir=args.dump if writes else None, microbatches=args.microbatches if args.pp > 1 else 1,
                          sharding="optim" if args.pp > 1 else "optim_grads_params", **precision(args))



def main(argv=None) -> dict:
    args = parse_args(argv)
    if min(args.steps, args.batch_size, args.dp, args.pp, args.ep, args.microbatches, args.log_every) < 1 \
            or args.copy_len < 2:
        raise SystemExit("--steps, --batch-size, --dp, --pp, --ep, --microbatches and --log-every must be >= 1, "
                         "--copy-len >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA device ({torch.__version__}); "
                         f"use --device cpu")
    if args.weights and not os.path.isdir(args.weights):
        raise SystemExit(f"--weights {args.weights}: no such directory")
    check_output_directory("--save", args.save, checkpoint=False)
    check_output_directory("--dump", args.dump)
    if args.dp * args.pp == 1 and args.ep == 1:
        return train(args)
    with torch.device("meta"):  # a bad mesh or cut fails here, once, before processes start
        model = build_model(args)
    fxshard.check(model, loss_fn, copy_batch(torch.Generator(), args.batch_size, args.copy_len, "cpu"),
                  optimizer=optimizer(args), mesh=mesh_of(args), config=config_of(args, 0))
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    return run_local(train, args.dp * args.pp, args, backend=backend)[-1]


def load_pretrained(model, directory: str) -> None:
    """`model`'s weights from what save_pretrained wrote in `directory`, every one of them: transformers
    itself fills the weights a directory lacks (another architecture's) with random values and only
    logs it, so a missing or left-over tensor (another --arch), or one of another shape (another
    size), stops the run here."""
    loaded, info = type(model).from_pretrained(directory, output_loading_info=True)
    problems = {what: info.get(what) for what in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(what)}
    if problems:
        detail = "; ".join(f"{what.replace('_', ' ')} {sorted(map(str, keys))[:4]} ({len(keys)} in all)"
                           for what, keys in problems.items())
        raise SystemExit(f"--weights {directory} does not hold this {type(model).__name__} (--arch): {detail}")
    try:
        model.load_state_dict(loaded.state_dict())
    except RuntimeError as error:  # the same architecture at another size (its own config.json)
        raise SystemExit(f"--weights {directory} holds a {type(model).__name__} of another size than this one: "
                         f"{str(error).splitlines()[0]} {str(error).splitlines()[1:2]}") from None


def train(args) -> dict:
    rank, processes = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = f"cuda:{rank}" if args.device == "cuda" and processes > 1 else args.device
    mesh = mesh_of(args) if processes > 1 else None
    rank_dp, world = (mesh.coords(rank)["dp"], args.dp) if mesh else (0, 1)
    say = print if rank == processes - 1 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    model = build_model(args).to(device)
    from_hub_layout = args.weights and os.path.exists(os.path.join(args.weights, "config.json"))
    if from_hub_layout:  # what save_pretrained wrote: transformers reads its own layout (MoE experts one by one)
        load_pretrained(model, args.weights)
    generator = torch.Generator().manual_seed(args.seed + 1)

    def next_batch():  # every rank draws the global batch and keeps its data-parallel rows
        batch = copy_batch(generator, args.batch_size * world, args.copy_len, device)
        return {k: v[rank_dp * args.batch_size:(rank_dp + 1) * args.batch_size] for k, v in batch.items()}

    say(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{args.batch_size} padded rows of {2 * args.copy_len + 1} per data-parallel rank, {mesh or 'one device'}")
    started = time.perf_counter()
    step = fxshard.shard(model, loss_fn, next_batch(), optimizer=optimizer(args), mesh=mesh,
                         config=config_of(args, rank))
    say(f"compiled in {time.perf_counter() - started:.1f}s: {step.program!r}")
    if args.weights:
        if not from_hub_layout:  # safetensors in the model's own names, read by each rank in its pieces
            fxshard.load_hf(step, args.weights)
        say(f"initialized from {args.weights}")
    losses = []
    started = time.perf_counter()
    for index in range(1, args.steps + 1):
        metrics = step(next_batch())
        losses.append(metrics["loss"].item())
        if index % args.log_every == 0 or index == args.steps:
            say(step_log(step, index, metrics), flush=True)
    evaluated = step.evaluate(next_batch())["loss"].item()  # eval mode, no update, on a fresh batch
    window = max(1, min(10, len(losses) // 2))  # first and last apart where the run is short
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    say(f"done: {len(losses)} steps in {time.perf_counter() - started:.1f}s; mean loss of first {window} steps "
        f"{first:.3f} -> last {window} steps {last:.3f}; evaluation loss {evaluated:.3f}")
    if args.save:
        step.copy_to(model)  # every rank takes part (the parameters are gathered over shards and stages)
    if args.save and rank == 0:  # transformers' save_pretrained writes on torch.distributed's rank 0 only
        model.save_pretrained(args.save)
        print(f"saved the trained model to {args.save}", flush=True)
    return {"first_loss": first, "last_loss": last, "eval_loss": evaluated, "losses": losses}


if __name__ == "__main__":
    try:
        main()
    except fxshard.FxShardError as error:
        raise SystemExit(f"fxshard: {error}") from None
