"""fxshard's custom ops: each has a reference implementation that runs anywhere, a fake (meta)
implementation for tracing and an autograd formula, so it traces into one readable graph node."""

from .adamw import adamw_update, adamw_update_
from .embedding_accumulate import embedding_accumulate, embedding_accumulate_
from .gather_rows import gather_rows
from .grouped_mlp import grouped_mlp
from .grouped_mm import grouped_mm, grouped_mm_wgrad
from .matmul_accumulate import matmul_accumulate, matmul_accumulate_

__all__ = ["adamw_update", "adamw_update_", "embedding_accumulate", "embedding_accumulate_", "gather_rows", "grouped_mlp", "grouped_mm", "grouped_mm_wgrad",
           "matmul_accumulate", "matmul_accumulate_"]
