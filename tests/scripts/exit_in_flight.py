"""Rank 0 attaches a callback to a gloo all_reduce that rank 1 joins late, and returns.

Its interpreter exits while the collective is still in flight: the callback then runs
on gloo's worker thread. ``raw`` attaches it with ``Future.then``, otherwise with
``ddpcomm.futures.then``. Rank 0 prints ``callback ran`` from the callback.
"""

import sys
import time

import torch
import torch.distributed as dist

from ddpcomm import futures

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
t = torch.ones(1 << 16)
if dist.get_rank() == 1:
    time.sleep(0.3)
work = dist.all_reduce(t, async_op=True)
if dist.get_rank() == 0:

    def report(fut):
        print(f"callback ran: {fut.value()[0][0].item():g}", flush=True)
        return fut.value()  # hands the collective's tensors on (the stream rule)

    attach = (lambda f, fn: f.then(fn)) if sys.argv[1:] == ["raw"] else futures.then
    attach(work.get_future(), report)
else:
    work.wait()
