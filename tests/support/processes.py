"""The environment of a process a test starts (a script, the launcher, a README block)."""

import os

from ringsplash.distributed import inherited_xla_flags


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child: its XLA flags without a simulated device count
    (the child sets its own, as ``scripts/launch_local.py`` does), then ``overrides``."""
    return {**os.environ, "XLA_FLAGS": inherited_xla_flags(os.environ.get("XLA_FLAGS")), **overrides}
