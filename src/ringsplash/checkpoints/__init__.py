"""Sharded, atomic, verified checkpoints (orbax).

- ``store``: save / restore / verify a training state and its data-iterator state;
- ``metadata``: what a checkpoint records beside its arrays, ``CheckpointCorruptError``;
- ``cli``: ``python -m ringsplash.checkpoints verify DIR``;
- ``full_disk``: one clear error when the disk fills during a save;
- ``leaves``: how a state's array leaves are stored and restored (records, restore targets);
- ``checksums``: sharding-independent checksums of arrays.
"""

from ringsplash.checkpoints.cli import main
from ringsplash.checkpoints.metadata import FORMAT, CheckpointCorruptError, CheckpointMetadata, config_hash
from ringsplash.checkpoints.store import (
    all_steps,
    data_state_file,
    latest_step,
    read_metadata,
    restore_data_iterator,
    restore_newest_valid,
    restore_state,
    save_state,
    set_aside,
    verify,
)

__all__ = [
    "FORMAT", "CheckpointCorruptError", "CheckpointMetadata", "all_steps", "config_hash", "data_state_file",
    "latest_step", "main", "read_metadata", "restore_data_iterator", "restore_newest_valid", "restore_state",
    "save_state", "set_aside", "verify",
]
