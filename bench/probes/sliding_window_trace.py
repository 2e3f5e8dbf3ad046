"""Which attention kernel, mask and flags transformers' sliding-window models trace to in bf16 on
CUDA, before and after fxshard's passes (passes/causal_attention.py, passes/flash_attention.py).

    python bench/probes/sliding_window_trace.py

Prints, per model, each attention call of the traced program and of the final one: its op, whether it
reads a mask and its is_causal flag, and the attention passes' dump notes.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fxshard  # noqa: E402
from fxshard.graph import call_argument  # noqa: E402
from fxshard.passes import run_pipeline  # noqa: E402

MASK_ARGUMENT = ("attn_bias", "attn_mask")


def models():
    import transformers

    small = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=256, attention_dropout=0.0)
    yield "mistral", transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **small))
    yield "qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=16, max_window_layers=1, **small))
    yield "gemma3", transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], **small))


def describe(program):
    rows = []
    for node in program.graph.nodes:
        name = str(node.target)
        if "attention" not in name or "backward" in name or node.op != "call_function":
            continue
        mask = next((call_argument(node, a) for a in MASK_ARGUMENT
                     if a in {x.name for x in node.target._schema.arguments}), None)
        causal = call_argument(node, "is_causal")
        window = node.kwargs.get("window_size_left")
        rows.append(f"{name.split('.')[-2]} mask={mask is not None} causal={causal} window_left={window}")
    return rows


def main():
    optimizer = fxshard.optim.SGD(lr=1.0)
    config = fxshard.Config(param_dtype=torch.bfloat16)
    for name, model in models():
        model = model.cuda()
        batch = {"idx": torch.randint(0, 64, (2, 64), device="cuda"), "tgt": torch.randint(0, 64, (2, 64), device="cuda")}

        def loss_fn(m, b):
            return F.cross_entropy(m(b["idx"]).logits.float().flatten(0, 1), b["tgt"].flatten())

        try:
            programs = run_pipeline(fxshard.trace(model, loss_fn, batch, optimizer=optimizer, config=config), None,
                                    config)
        except Exception as error:  # a probe: report and go on
            print(f"{name}: {type(error).__name__}: {error}")
            continue
        print(f"== {name}: traced")
        for row in describe(programs[0]):
            print("   ", row)
        print(f"== {name}: final ({programs[-1].name})")
        for row in describe(programs[-1]):
            print("   ", row)
        for key in ("causal_attention", "flash_attention"):
            print(f"    note {key}: {programs[-1].notes.get(key)}")


if __name__ == "__main__":
    main()
