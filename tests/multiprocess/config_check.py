"""Worker for the config-mismatch test: ``--same`` gives every process one config, otherwise
each process's config differs (as when a launch passes different flags to one worker)."""

import sys

import jax

from ringsplash.distributed import check_same_config

config = {"steps": 10} if "--same" in sys.argv else {"steps": 10 + jax.process_index()}
check_same_config(config)
print(f"CONFIG OK process {jax.process_index()}", flush=True)
