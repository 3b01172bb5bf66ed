"""Per-device ring schedules: each device holds only its own q shard's work lists.

A ring's host plan (``ring.RingPlan``) holds the work lists of every (q shard, kv shard) pair,
``[lists, N, N, steps]``, but device ``i`` only ever reads row ``i`` (its q shard against each
visiting kv shard). A :class:`RingSchedule` is those arrays, already cut into the pieces the
SMEM budget allows (``splash/work_pieces.py``), as a pytree whose leaves are sharded over the
ring axis on their q-shard dimension (``P(None, axis_name)``): passed into ``shard_map`` (and
into ``jit`` as an argument), each device receives ``[lists, 1, N, steps_j]``, O(N · steps)
metadata instead of O(N² · steps). The piece ranges are static pytree metadata.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash.mask_info import MaskInfo
from ringsplash.splash import work_pieces
from ringsplash.splash.work_pieces import Piece, PieceSchedules, SplitLists

__all__ = ["PieceSchedules", "RingSchedule", "process_rows", "schedule_arrays", "schedule_from_splits",
           "schedule_shapes"]


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """Work lists of a ring with their SMEM pieces: ``fwd`` / ``dkv`` are ``(q_block, kv_block,
    kind, partial_index, bounds)`` of the forward / dq view and of the transposed dK/dV view
    (None for the xla backend): the MaskInfo's arrays ``[lists, q_rows, N, steps]`` and the
    pieces' ``bounds`` ``[lists, q_rows, N, pieces, 2]`` (``work_pieces.SplitLists``); ``q_rows``
    is N for the whole schedule and 1 for one device's slice inside ``shard_map``."""

    fwd: tuple
    dkv: tuple | None
    fwd_pieces: tuple[Piece, ...] = dataclasses.field(metadata={"static": True})
    dkv_pieces: tuple[Piece, ...] | None = dataclasses.field(metadata={"static": True})

    def pair(self, info: MaskInfo, info_dkv: MaskInfo | None, q_shard, kv_shard):
        """``(PieceSchedules, PieceSchedules | None)`` of q shard ``q_shard`` (ignored when this is
        a per-device slice) against kv shard ``kv_shard`` (either may be traced)."""
        row = 0 if self.fwd[0].shape[1] == 1 else q_shard
        fwd = work_pieces.pair_schedules(self.fwd_pieces, self.fwd[:4], self.fwd[4], info.head_to_list, row,
                                         kv_shard, transpose=False)
        dkv = None
        if self.dkv is not None:
            dkv = work_pieces.pair_schedules(self.dkv_pieces, self.dkv[:4], self.dkv[4], info_dkv.head_to_list, row,
                                             kv_shard, transpose=True)
        return fwd, dkv

    def specs(self, axis_name):
        """``PartitionSpec`` s sharding every leaf's q-shard dimension over ``axis_name``."""
        return jax.tree.map(lambda _: P(None, axis_name), self)

    @property
    def nbytes_per_device(self) -> int:
        """Bytes of one device's slice (the whole schedule's bytes / q rows)."""
        leaves = jax.tree.leaves(self)
        return sum(int(np.prod(x.shape)) // x.shape[1] * np.dtype(x.dtype).itemsize for x in leaves)


jax.tree_util.register_dataclass(RingSchedule)


def schedule_from_splits(split: SplitLists, split_dkv: SplitLists | None, q_rows=None) -> RingSchedule:
    """A numpy :class:`RingSchedule` of the q shards ``q_rows`` (None = all)."""
    rows = slice(None) if q_rows is None else np.asarray(q_rows)
    take = lambda sp: tuple(np.asarray(a)[:, rows] for a in (*sp.arrays, sp.bounds))
    return RingSchedule(
        fwd=take(split), dkv=None if split_dkv is None else take(split_dkv),
        fwd_pieces=split.pieces, dkv_pieces=None if split_dkv is None else split_dkv.pieces,
    )


def schedule_arrays(build_rows, whole: RingSchedule, mesh, axis_name) -> RingSchedule:
    """Global ``jax.Array`` s sharded ``P(None, axis_name)`` over ``mesh``; ``build_rows(rows)``
    gives the numpy schedule of q shards ``rows``, and is called only for the rows of this
    process's devices. ``whole`` supplies shapes (its arrays may be ``ShapeDtypeStruct`` s)."""
    specs = whole.specs(axis_name)

    def make(path_leaf, spec):
        path, leaf = path_leaf
        sharding = NamedSharding(mesh, spec)

        def cb(index):
            rows = range(*index[1].indices(leaf.shape[1]))
            local = build_rows(tuple(rows))
            return np.asarray(_at(local, path))[(slice(None), slice(None)) + tuple(index[2:])]

        return jax.make_array_from_callback(leaf.shape, sharding, cb)

    flat, treedef = jax.tree_util.tree_flatten_with_path(whole)
    spec_leaves = jax.tree.leaves(specs)
    return jax.tree_util.tree_unflatten(treedef, [make(pl, s) for pl, s in zip(flat, spec_leaves)])


def process_rows(mesh, axis_name) -> tuple[int, ...]:
    """The ring positions (q shards) along ``axis_name`` (a name or tuple of names) of ``mesh``'s
    devices that this process addresses, ascending: the rows its schedule needs."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    axes = [mesh.axis_names.index(a) for a in names]
    devices = np.moveaxis(mesh.devices, axes, list(range(len(axes)))).reshape(
        int(np.prod([mesh.devices.shape[a] for a in axes])), -1)
    me = jax.process_index()
    return tuple(i for i, row in enumerate(devices) if any(d.process_index == me for d in row))


def _at(tree, path):
    for key in path:
        tree = getattr(tree, key.name) if hasattr(key, "name") else tree[key.idx]
    return tree


def schedule_shapes(whole: RingSchedule, mesh, axis_name) -> RingSchedule:
    """``jax.ShapeDtypeStruct`` s of the schedule, sharded ``P(None, axis_name)`` (AOT lowering)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        whole, whole.specs(axis_name),
    )

