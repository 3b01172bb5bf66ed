"""Sharded, atomic, verified checkpoints (orbax).

- ``store``: save / restore / verify a training state and its data-iterator state
  (``python -m ringsplash.checkpoints verify DIR``);
- ``leaves``: how a state's array leaves are stored and restored (records, restore targets);
- ``checksums``: sharding-independent checksums of arrays.
"""

from ringsplash.checkpoints.store import (
    FORMAT,
    CheckpointCorruptError,
    CheckpointMetadata,
    all_steps,
    config_hash,
    data_state_file,
    latest_step,
    main,
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
