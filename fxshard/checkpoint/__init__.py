"""Checkpoints: a step's training state saved and loaded by global parameter names (torch.distributed
.checkpoint), Hugging Face safetensors export and import, and expert-weight layouts.

    fxshard/checkpoint/items.py    where each element of a rank's state lies in the global tensors
    fxshard/checkpoint/state.py    that state as DCP state dicts (rectangles of global tensors)
    fxshard/checkpoint/dcp.py      fxshard.save / fxshard.load: directories, checks, async writes
    fxshard/checkpoint/hf.py       fxshard.export_hf / fxshard.load_hf: transformers' Llama and Mixtral
    fxshard/checkpoint/experts.py  expert-weight layouts (grouped / indexed keys, GLU interleaving)
"""

from .dcp import PendingSave, load, read_tensors, save
from .experts import (LAYOUTS, ExpertLayout, convert_expert_tensors, deinterleave_glu, interleave_glu,
                      layout_of)
from .hf import export_hf, load_hf
from .state import LoadPlanner, SavePlanner

__all__ = ["save", "load", "read_tensors", "export_hf", "load_hf", "PendingSave", "SavePlanner", "LoadPlanner", "ExpertLayout", "LAYOUTS",
           "convert_expert_tensors", "interleave_glu", "deinterleave_glu", "layout_of"]
