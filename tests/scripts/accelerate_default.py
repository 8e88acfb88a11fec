"""A training script that lets accelerate decide where to run (``Accelerator()``, no
``cpu=True``): on a machine without a GPU accelerate builds no DDP model, even under
``accelerate launch --multi_gpu`` (tests/test_frameworks.py)."""

import torch
import torch.nn as nn
from accelerate import Accelerator

if __name__ == "__main__":
    accelerator = Accelerator()
    module = nn.Linear(8, 8)
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        accelerator.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
    print(f"process {accelerator.process_index}: {type(model).__name__}", flush=True)
