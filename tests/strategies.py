"""Shared hypothesis strategies and small models for the pass property tests."""

import torch
import torch.nn as nn
from hypothesis import strategies as st


class MLPStack(nn.Module):
    """A regression MLP whose widths may be tiny (parameters smaller than the world size)."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.inp = nn.Linear(3, widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:] + widths[-1:]))
        self.out = nn.Linear(widths[-1], 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def regression_batch(generator, rows):
    return {"x": torch.randn(rows, 3, generator=generator), "y": torch.randn(rows, 1, generator=generator)}


widths = st.lists(st.integers(1, 7), min_size=1, max_size=4)
worlds = st.integers(1, 8)
