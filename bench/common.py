"""What the benchmarks share: the peak MFU is reported against, and how a result file is written."""

from __future__ import annotations

import datetime
import json
import os

import torch

H200_BF16_DENSE_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM: the denominator of every MFU here


def device_name() -> str:
    """The GPU's name, or "cpu" where there is none (the CPU smoke runs of a benchmark)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str, **fields) -> None:
    """`fields`, with the date, the GPU and torch's version first, as JSON at `path`; prints where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"date": datetime.date.today().isoformat(), "device": device_name(),
                   "torch": torch.__version__, **fields}, handle, indent=1)
    print(f"wrote {path}")
