"""passes/flash_attention.py's recognition of a sliding-window mask (CPU: the pass itself runs only on
CUDA, tests/passes/test_attention_cuda.py): the window W where every slice lets query i see keys
i - W + 1 .. i, and None for anything else."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard.passes.flash_attention import _window

ROWS = 16


def mask_node(build):
    """The graph of `x + build(x)` (make_fx, aten ops) and the node of build's mask."""
    graph_module = make_fx(lambda x: x + build(x))(torch.zeros(2, 3, ROWS, ROWS))
    (add,) = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    return add.args[1], graph_module


def additive(width, blocked=float("-inf"), flip=None):
    def build(x):
        i = torch.arange(ROWS)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < width)
        if flip is not None:  # functionally, as fxshard's traces are
            allowed = allowed ^ ((i[:, None] == flip[0]) & (i[None, :] == flip[1]))
        return torch.zeros(ROWS, ROWS).masked_fill(~allowed, blocked).expand(2, 3, ROWS, ROWS)
    return build


@pytest.mark.parametrize("width, blocked", [(4, float("-inf")), (1, -65536.0), (ROWS, float("-inf")), (7, -1e9)])
def test_a_causal_band_is_its_window(width, blocked):
    assert _window(*mask_node(additive(width, blocked)), ROWS, ROWS) == width


@pytest.mark.parametrize("case", ["all blocked", "a flipped entry", "weakly blocked", "reads the input", "rectangle"])
def test_anything_else_is_no_window(case):
    build = {"all blocked": additive(0), "a flipped entry": additive(4, flip=(9, 2)),
             "weakly blocked": additive(4, blocked=-1000.0),
             "reads the input": lambda x: additive(4)(x) * (x[..., :1] == 0),
             "rectangle": additive(4)}[case]
    node, graph_module = mask_node(build)
    assert _window(node, graph_module, ROWS, ROWS + (case == "rectangle")) is None
