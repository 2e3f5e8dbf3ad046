"""Node-metadata keys, in one place. Passes read and write node.meta only through these."""

import torch

PHASE = "fxshard_phase"   # "fwd" | "bwd" | "optim"
LAYER = "fxshard_layer"   # "pre", "post", or a layer's module path such as "layers.3"
PARAM = "fxshard_param"   # parameter name on parameter inputs, their gradients and updates
MICROBATCH = "fxshard_microbatch"  # which microbatch's forward/backward a node belongs to (0-based)
ACTION = "fxshard_action"  # in a pipeline stage's program: the schedule action that made the node ("F0:3")
ACTION_INDEX = "fxshard_action_index"  # ... and its position in the stage's actions (StagePlan.actions)
LOSS_TANGENT = "fxshard_loss_tangent"  # True on the constant the backward starts from (d loss / d loss)
# On the optimizer phase's non-finite flags (Config(nonfinite)): the tensor each flag is about.
NONFINITE_TENSORS = "fxshard_nonfinite_tensors"

FWD, BWD, OPTIM = "fwd", "bwd", "optim"
PHASES = (FWD, BWD, OPTIM)
PRE, POST = "pre", "post"

# Key under torch.fx.traceback.annotate's "custom" dict that carries the layer during tracing.
ANNOTATION_LAYER = "fxshard_layer"
ANNOTATION_PARAM = "fxshard_param"
# ... and the number of the torch.utils.checkpoint call a forward node was made in (fxshard/trace.py);
# on the program's forward nodes as RECOMPUTE, which passes/recompute.py reads
ANNOTATION_RECOMPUTE = "fxshard_recompute"
ANNOTATION_RECOMPUTE_CALLS = "fxshard_recompute_calls"  # ... and of every call enclosing it, outermost first
RECOMPUTE = "fxshard_recompute"
# ... and, on such a node, that the call's selective checkpointing policy saves its value (not computed again)
SAVED = "fxshard_saved"


def phase(node) -> str | None:
    return node.meta.get(PHASE)


def layer(node) -> str | None:
    return node.meta.get(LAYER)


def param(node) -> str | None:
    return node.meta.get(PARAM)


def microbatch(node) -> int:
    return node.meta.get(MICROBATCH, 0)


def action(node) -> str | None:
    return node.meta.get(ACTION)


def action_index(node) -> int | None:
    return node.meta.get(ACTION_INDEX)

# Set by passes on the collectives they insert, for the dumps.
UNIT = "fxshard_unit"            # the FSDP unit a collective moves
COMM_BYTES = "fxshard_comm_bytes"  # bytes one rank sends into the collective
# Set by the expert-parallel pass on the nodes of each MoE layer it rewrites: which piece of the layer
# a node belongs to ("route": the all-to-all plan, "dispatch", "experts", "combine"), and which
# token-row chunk (ep_overlap); the pieces a combined fwd/bwd schedule would interleave.
MOE_PIECE = "fxshard_moe_piece"
MOE_ROUTE = "route"  # the MOE_PIECE of a layer's count exchange (a few bytes per expert)
MOE_CHUNK = "fxshard_moe_chunk"
MOE_REJECTED = "fxshard_moe_rejected"  # on offsets passes/recognize_moe did not recognize: why


_c10d = torch.ops._c10d_functional
# The functional collectives the passes issue; each result is read through a wait_tensor.
# (all_gather_into_tensor_out only in runtime graphs: runtime/reinplace.py gathers updated shards into parameters)
COLLECTIVE_ISSUES = frozenset({_c10d.all_to_all_single.default, _c10d.all_gather_into_tensor.default,
                               _c10d.all_gather_into_tensor_out.default, _c10d.reduce_scatter_tensor.default,
                               _c10d.all_reduce.default})


def is_moe_all_to_all(node) -> bool:
    """An all-to-all the expert-parallel pass issued (route, dispatch or combine)."""
    return node.target is _c10d.all_to_all_single.default and MOE_PIECE in node.meta
