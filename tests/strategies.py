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


def token_batches(world, steps, local_batch=2, seq=16, vocab=64, seed=0):
    """`steps` global batches of random tokens for `world` ranks of `local_batch` rows each."""
    generator = torch.Generator().manual_seed(seed)
    shape = (world * local_batch, seq)
    return [{"idx": torch.randint(0, vocab, shape, generator=generator),
             "tgt": torch.randint(0, vocab, shape, generator=generator)} for _ in range(steps)]


def local_part(batch, rank, local_batch=2):
    """Rank `rank`'s rows of a global batch."""
    return {k: v[rank * local_batch:(rank + 1) * local_batch] for k, v in batch.items()}


def rank_batches(world, rows, seq=8, vocab=64, seed=0):
    """One batch of random tokens per rank: `world` dicts of `rows` x `seq` idx / tgt."""
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
             "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)} for _ in range(world)]
