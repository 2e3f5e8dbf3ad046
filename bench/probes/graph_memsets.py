"""What a memset node costs in a CUDA graph, against the kernel node runtime/graph_memsets.py puts in
its place: GPT 1b's block (1x2048 tokens, bf16: the QKV GEMM, cuDNN attention forward, the O, W1, W3
and W2 GEMMs; cuBLAS and cuDNN capture memsets before four of them), BLOCKS times in one graph,
captured three times: as captured ("keep"), rewritten ("kernels"), and as captured again ("keep-again",
the noise floor of the bit-identity check).

    python bench/probes/graph_memsets.py [--blocks 40] [--replays 20] [--out FILE.json]

Prints per variant: memset nodes replaced, ms a replay (CUDA events, median of --replays), us saved
per memset; and which outputs are bit-identical (the graphs' to each other, the rewritten one's to eager).
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxshard.runtime.graph_memsets import finish_capture, new_graph  # noqa: E402

TOKENS, D, FF, HEADS = 2048, 2048, 5632, 16


def make_block():
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = {name: torch.randn(shape, device=dev, dtype=dt, generator=g) * 0.02 for name, shape in
         (("qkv", (3 * D, D)), ("o", (D, D)), ("w1", (FF, D)), ("w3", (FF, D)), ("w2", (D, FF)))}

    def block(x):
        q, k, v = (x @ w["qkv"].t()).view(1, TOKENS, 3, HEADS, D // HEADS).unbind(2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + a.transpose(1, 2).reshape(TOKENS, D) @ w["o"].t()
        return x + (F.silu(x @ w["w1"].t()) * (x @ w["w3"].t())) @ w["w2"].t()

    return block


def run(blocks: int, replays: int) -> dict:
    block = make_block()
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))

    def body(x):
        for _ in range(blocks):
            x = block(x) * 0.5
        return x

    eager = body(x)
    result = {"blocks": blocks}
    outputs = {}
    stream = torch.cuda.Stream()  # one capture stream: cuBLAS keeps a workspace per stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body(x)  # warm-up on it: cuBLAS and cuDNN pick their kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    for variant in ("keep", "kernels", "keep-again"):  # keep-again: the noise floor of bit identity
        rewrite = variant == "kernels"
        graph = new_graph(rewrite)
        with torch.cuda.graph(graph, stream=stream):
            out = body(x)
        report = finish_capture(graph, rewrite, torch.cuda.current_device())
        times = []
        for _ in range(replays + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        outputs[variant] = out.clone()
        result[variant] = {"ms": statistics.median(times[3:]), "report": report.line(), "replaced": report.replaced}
        del graph
    memsets = result["kernels"]["replaced"]
    result["us_saved_per_memset"] = ((result["keep"]["ms"] - result["kernels"]["ms"]) * 1e3 / memsets
                                     if memsets else None)
    result["bit_identical_keep_twice"] = torch.equal(outputs["keep"], outputs["keep-again"])
    result["bit_identical_kernels_keep"] = torch.equal(outputs["keep"], outputs["kernels"])
    result["bit_identical_kernels_eager"] = torch.equal(outputs["kernels"], eager)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} blocks of GPT 1b forward in one graph")
    result = run(args.blocks, args.replays)
    print(f"{'variant':<8} {'ms/replay':>10}  report")
    for variant in ("keep", "kernels", "keep-again"):
        print(f"{variant:<8} {result[variant]['ms']:>10.3f}  {result[variant]['report']}")
    saved = result["us_saved_per_memset"]
    print(f"saved per memset: {saved:.2f} us" if saved is not None else "no memset replaced")
    print(f"bit-identical: keep and keep-again {result['bit_identical_keep_twice']}, kernels and keep "
          f"{result['bit_identical_kernels_keep']}, kernels and eager {result['bit_identical_kernels_eager']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **result}, f, indent=1)


if __name__ == "__main__":
    main()
