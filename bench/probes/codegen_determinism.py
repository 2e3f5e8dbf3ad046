"""Are two separately sharded steps with codegen bit-identical (eager replay twice, and eager vs CUDA
graphs)? Prints the parameters that differ and by how much."""
import copy
import sys

import torch

sys.path.insert(0, ".")
import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny")).cuda()
g = torch.Generator().manual_seed(0)
batches = [{"idx": torch.randint(0, 64, (4, 32), generator=g).cuda(),
            "tgt": torch.randint(0, 64, (4, 32), generator=g).cuda()} for _ in range(8)]
runs = {}
for label, codegen, graphs in [("aten", None, False), ("inductor-a", "inductor", False),
                               ("inductor-b", "inductor", False), ("inductor-graphed", "inductor", True)]:
    step = fxshard.shard(copy.deepcopy(model), lambda m, b: m.loss(b), batches[0], optimizer=ADAMW,
                         config=fxshard.Config(codegen=codegen, cuda_graphs=graphs))
    losses = [step(b)["loss"].item() for b in batches]
    runs[label] = (losses, step.parameters())
for a, b in [("inductor-a", "inductor-b"), ("inductor-a", "inductor-graphed"), ("aten", "inductor-a")]:
    (la, pa), (lb, pb) = runs[a], runs[b]
    differ = {k: (pa[k] - pb[k]).abs().max().item() for k in pa if not torch.equal(pa[k], pb[k])}
    first = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)
    print(f"{a} vs {b}: losses first differ at step {first}; {len(differ)} of {len(pa)} parameters differ:",
          dict(list(differ.items())[:4]))
