"""What a checkpoint records beside its arrays (readable without loading any), and the error of a
checkpoint that does not match it."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ringsplash.checkpoints.leaves import LeafInfo
from ringsplash.distributed import config_digest

__all__ = ["FORMAT", "CheckpointCorruptError", "CheckpointMetadata", "config_hash"]

FORMAT = "ringsplash.checkpoints/1"


class CheckpointCorruptError(ValueError):
    """A checkpoint whose files cannot be read, or whose arrays do not match the checksums its
    metadata records; the message names the checkpoint (and the array, for a mismatch)."""


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint holds, readable without loading any array (``read_metadata``)."""

    step: int
    config: Mapping[str, Any] | None  # the run's configuration (JSON-able), if one was given
    config_hash: str | None  # ``config_hash(config)``
    leaves: tuple[LeafInfo, ...]
    process_count: int  # processes that wrote it (restoring with another count is fine)
    # sha256 of each data-iterator state file (``data/process_<i>-of-<n>.json``, its JSON in
    # canonical form); None: saved without a data iterator, or before these were recorded
    data_checksums: Mapping[str, str] | None = None
    format: str = FORMAT


def config_hash(config: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-able config (key order does not matter): ``distributed.config_digest``."""
    return config_digest(config)
