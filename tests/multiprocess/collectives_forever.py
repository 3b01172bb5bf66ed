"""A worker that runs cross-process collectives until it is stopped (tests of a lost peer):
writes its pid to ``$PID_DIR/<process>.pid`` and prints READY once the processes have met."""

import os
import time

import jax
from jax.experimental import multihost_utils

me = jax.process_index()
with open(os.path.join(os.environ["PID_DIR"], f"{me}.pid"), "w") as f:
    f.write(str(os.getpid()))
multihost_utils.sync_global_devices("start")
print(f"READY process {me}", flush=True)
i = 0
while True:
    multihost_utils.sync_global_devices(f"step {i}")
    i += 1
    time.sleep(0.05)
