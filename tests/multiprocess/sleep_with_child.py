"""Worker for the launcher's stop tests: starts a child of its own (``sleep``, in the worker's
process group), writes ``<worker pid> <child pid>`` to ``$PID_DIR/<process>.pid``, prints READY
and sleeps: only being stopped ends it."""

import os
import subprocess
import time

import jax

child = subprocess.Popen(["sleep", "600"])
path = os.path.join(os.environ["PID_DIR"], f"{jax.process_index()}.pid")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(path + ".tmp", path)  # whole or absent: the test reads it as soon as it exists
print(f"READY process {jax.process_index()}", flush=True)
time.sleep(600)
