"""A plain training loop on the checkpoint manager, run by the RAM tier's tests:

    python ram_loop.py RUN KILL_AT NAN_AT MEMORY_EVERY sync|async END

durable saves every 50 steps, RAM saves every MEMORY_EVERY (0: none); SIGKILL after step KILL_AT
(0: never); the weights hold a NaN from step NAN_AT on (0: never); ``close(END)`` at the end.
Prints ``START step tier`` after the restore and the manager's log as ``LOG ...``."""
import os
import signal
import sys

import torch

from ckptfmt.torch import CheckpointManager

run, kill_at, nan_at, memory_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
async_save, end = sys.argv[5] == "async", int(sys.argv[6])
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
mgr = CheckpointManager(run, model, opt, generators={"data": data}, every=50,
                        memory_every=memory_every or None, async_save=async_save,
                        log=lambda m: print("LOG", m, flush=True))
start = mgr.restore()
print("START", start, mgr.restored_tier, flush=True)
for step in range(start + 1, end + 1):
    loss = model(torch.randn(32, 16, generator=data)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == nan_at:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    mgr.step(step, loss=loss.item())
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
mgr.close(end)
