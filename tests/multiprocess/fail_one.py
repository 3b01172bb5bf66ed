"""Worker for the launcher's failure-path test: process 1 raises, every other process would hang.

Each process writes its pid to ``$PID_DIR/<process>.pid`` first, so the test can check that no
process outlives the launcher.
"""

import os
import sys
import time

import jax

pid_dir = os.environ["PID_DIR"]
with open(os.path.join(pid_dir, f"{jax.process_index()}.pid"), "w") as f:
    f.write(str(os.getpid()))
if jax.process_index() == 1:
    raise RuntimeError("process 1 fails on purpose")
time.sleep(600)  # a process waiting for a peer that will never come
sys.exit(0)
