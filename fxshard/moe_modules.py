"""MoE modules whose forward fxshard swaps while it traces: `fxshard.register_moe`.

`passes/recognize_moe.py` recognizes MoE layers by their dataflow (a sort of the top-k expert ids,
counted offsets, grouped GEMMs). A layer written another way — a Python loop over experts that reads
the routing on the host, one weight copy gathered per token (`bmm`), a kernel fxshard cannot see
into — is not recognized, and some of them cannot be traced at all. For those, register a forward
that computes the same function with fxshard's primitives (`fxshard.moe.dispatch` / `combine`,
`fxshard.ops.grouped_mm`, or plain torch ops in the recognized form):

    def forward(module, x):                     # the module's own arguments follow `module`
        ...                                     # same result as module.forward(x)
    fxshard.register_moe(MyMoE, forward)

While fxshard traces a model (shard, check, trace, evaluate), every instance of the type
(subclasses included) runs `forward(module, *args, **kwargs)` instead of its own forward; the model
is not edited and runs its own code outside fxshard. The parameters stay the module's: the forward
reads them as attributes, so names, checkpoints and expert parallelism see the model's own tensors.
The traced program's notes (and the dump's summary) list every module swapped.

Built in, after the user's registrations: transformers' experts modules (classes decorated with
`use_experts_implementation`: Mixtral, Qwen2/3-MoE, DeepSeek, ...) configured with another
implementation than "grouped_mm" ("eager" loops over experts on the host and cannot be traced;
"batched_mm" gathers a weight matrix per token) trace with transformers' own "grouped_mm"
implementation, which computes the same function, so that the recognizer finds them. And
transformers' Llama 4 MoE (`Llama4TextMoe`), which runs every expert over every token (one batched
matmul, the inputs of the experts a token did not choose scaled by a zero score), traces as the
sparse layer it computes: `_llama4_text_moe`.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator

import torch
import torch.nn as nn

from .errors import FxShardError

_registered: dict[type, Callable] = {}


def register_moe(module_type: type, forward: Callable | None) -> None:
    """While fxshard traces, instances of `module_type` run `forward(module, *args, **kwargs)` (module
    docstring). Registering a type again replaces its forward; `forward=None` removes it."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise FxShardError(f"register_moe takes an nn.Module subclass, got {module_type!r}")
    if forward is None:
        _registered.pop(module_type, None)
        return
    if not callable(forward):
        raise FxShardError(f"register_moe({module_type.__name__}, forward): forward must be callable "
                           f"(module, *args, **kwargs) -> output, got {forward!r}")
    _registered[module_type] = forward


def _forward_for(module: nn.Module) -> tuple[Callable, str] | None:
    for module_type in type(module).__mro__:
        if module_type in _registered:
            forward = _registered[module_type]
            return forward, f"registered {getattr(forward, '__qualname__', forward)!s}"
    return _transformers_experts(module) or _llama4(module)


# transformers' own experts implementations that compute what its "grouped_mm" one does (a loop over
# experts, batched GEMMs): traced as that one, which the MoE recognizer knows. A custom implementation
# (ExpertsInterface.register) may compute something else, and is traced as written.
_SAME_AS_GROUPED_MM = ("eager", "batched_mm")


def _transformers_experts(module: nn.Module) -> tuple[Callable, str] | None:
    """transformers' experts modules on one of its implementations of the same function as
    "grouped_mm" (`_SAME_AS_GROUPED_MM`): that implementation."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if not hasattr(module, "_is_expert_parallel") or implementation not in _SAME_AS_GROUPED_MM:
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    grouped = ALL_EXPERTS_FUNCTIONS.get("grouped_mm")
    if grouped is None:
        return None
    return grouped, f"transformers' {implementation!r} experts traced as its 'grouped_mm' experts (same function)"


def _llama4(module: nn.Module) -> tuple[Callable, str] | None:
    """transformers' Llama 4 MoE exactly as transformers writes it (not a subclass: it may compute
    otherwise): `_llama4_text_moe`."""
    kind = type(module)
    if kind.__name__ != "Llama4TextMoe" or not kind.__module__.startswith("transformers.models.llama4"):
        return None
    parts = {"experts": "Llama4TextExperts", "router": "Llama4Router"}
    if any(type(getattr(module, name, None)).__name__ != part for name, part in parts.items()):
        return None
    return _llama4_text_moe, ("transformers' Llama 4 MoE, every expert over every token, traced as the sparse "
                              "layer it computes (the experts each token chose: same function)")


def _llama4_text_moe(module: nn.Module, hidden_states: torch.Tensor):
    """What transformers' `Llama4TextMoe.forward` computes, routing each token to its top-k experts only.

    transformers runs every expert over every token, each expert's input scaled by the token's score
    for it: sigmoid(logit) for its top-k experts, sigmoid(-inf) = 0 for the others. An expert
    (gate_up, then up * act(gate), then down, no biases) maps a zero input to a zero output with a
    zero input gradient, so the other experts add exact zeros to the sum and nothing to the
    gradients: this forward computes the chosen experts only (E / k times fewer expert FLOPs), on
    rows laid out by `fxshard.moe.dispatch`, so expert parallelism splits the layer. Being a dispatch
    call, it is bounded by Config(moe_capacity_factor) where one is set: tokens over an expert's
    capacity are then dropped, which the model's own code never does."""
    from . import moe
    from .ops import grouped_mm

    tokens = hidden_states.reshape(-1, module.hidden_dim)
    scores, logits = module.router(tokens)                      # [T, E]: zero but at each token's top-k
    chosen = torch.topk(logits, module.top_k, dim=1).indices    # the router's own top-k: same ties
    weights = scores.gather(1, chosen)                          # [T, k]
    routed = moe.dispatch(tokens, chosen, n_experts=module.num_experts, distinct=True)
    rows = routed.rows * weights.reshape(-1)[routed.order].unsqueeze(-1)  # scaled before the experts
    experts = module.experts
    gate, up = grouped_mm(rows, routed.offsets, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out_rows = grouped_mm(experts.act_fn(gate) * up, routed.offsets, experts.down_proj.transpose(1, 2))
    out = module.shared_expert(tokens)
    return out + moe.combine(out_rows, routed, torch.ones_like(weights), tokens.shape[0]), logits


@contextlib.contextmanager
def swapped_forwards(model: nn.Module) -> Iterator[list[str]]:
    """Every registered module of `model` runs its registered forward inside; yields "path: how" lines."""
    swapped, lines = [], []  # (module, the instance's own forward attribute if it had one)
    try:
        for path, module in model.named_modules():
            found = _forward_for(module)
            if found is None:
                continue
            forward, how = found
            swapped.append((module, vars(module).get("forward")))
            module.forward = types.MethodType(forward, module)  # an instance attribute, shadowing the class's
            lines.append(f"{path}: {type(module).__name__}, {how}")
        yield lines
    finally:
        for module, own in swapped:
            if own is None:
                del module.forward
            else:
                module.forward = own
