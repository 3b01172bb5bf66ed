"""Host plan of a ring: which blocks each (q shard, kv shard) pair runs, and in what pieces.

Host-only numpy, built once per (mask, layout, N, blocks) and cached; nothing here is traced.
:func:`ring_plan` builds one ``MaskInfo`` for every shard pair (the forward / dq view and, for
the kernel backends, the transposed dK/dV view) from the global mask on original positions and
the layout's permutation: O(non-empty blocks + S), never a dense S x S mask.

Per-device schedules. A plan holds the work lists of every pair, ``[lists, N, N, steps]``, but
device ``i`` only ever reads row ``i`` (its q shard against each visiting kv shard). A
:class:`RingSchedule` is those arrays, already cut into the pieces the SMEM budget allows
(``splash/work_pieces.py``), as a pytree whose leaves are sharded over the ring axis on their
q-shard dimension (``P(None, axis_name)``): passed into ``shard_map`` (and into ``jit`` as an
argument), each device receives ``[lists, 1, N, steps_j]``, O(N · steps) metadata instead of
O(N² · steps). The piece ranges are static pytree metadata. :func:`ring_schedule` builds it; on a
multi-host slice each process builds only its own devices' rows.

Balance. :func:`ring_work` counts each pair's non-empty blocks; :func:`critical_path` sums, over
the ring's steps, the busiest device's work (device ``a`` holds kv shard ``(a - t) mod N`` at
step ``t``).
"""

import concurrent.futures
import dataclasses
import itertools
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash import masks as masks_lib
from ringsplash._internal.caches import factories
from ringsplash._internal.scalar_checks import check_divides, check_positive_int
from ringsplash.blocksparse.mask_info import MaskInfo, build_mask_info
from ringsplash.parallel.ring_tuning import ring_config
from ringsplash.splash import work_pieces
from ringsplash.splash.blocks import Blocks, Extent, fit_blocks
from ringsplash.splash.config import NUM_LANES, SplashConfig
from ringsplash.splash.partial_tiles import partial_mode
from ringsplash.splash.work_pieces import Piece, SplitLists

__all__ = ["RingBlocks", "RingPlan", "RingSchedule", "ScheduleKey", "check_schedule",
           "critical_path", "fit_ring_blocks", "process_rows", "ring_config", "ring_plan", "ring_schedule", "ring_work",
           "rows_schedule", "schedule_arrays", "schedule_from_splits", "schedule_shapes"]


# ----------------------------------------------------------------------------------------
# the plan: MaskInfo for every shard pair, built once per (mask, layout, N, blocks)


@dataclasses.dataclass(frozen=True, eq=False)
class RingPlan:
    info: MaskInfo  # forward / dq view, [lists, N, N, max_steps]
    info_dkv: MaskInfo | None  # transposed dK/dV view (None for the xla backend, which skips it)
    positions: np.ndarray  # int32 [N, S/N] original positions of each shard's tokens
    active: np.ndarray  # bool [N, N]: shard pair (q shard, kv shard) has a non-empty block


#: the ring's fitted blocks (``splash/blocks.py``: the rule every path follows)
RingBlocks = Blocks


def fit_ring_blocks(seq_len: int, num_shards: int, layout: layouts.Layout, config: SplashConfig) -> RingBlocks:
    """``config``'s blocks fitted to the ring's shards (every zigzag half-shard): the rule of
    ``splash/blocks.py`` with the shard as the array the kernels tile, so a ring that runs here
    also lowers for TPU.

    Args:
        seq_len: global sequence length S.
        num_shards: devices N on the ring axis.
        layout: token layout (zigzag splits each shard into two halves of S / 2N).
        config: the user's ``SplashConfig``.

    Raises:
        ValueError: naming the ``SplashConfig`` blocks (or the S) that would work, when no
            block tiles the shards.
    """
    layouts.check_layout(layout, seq_len, num_shards)
    parts = 2 * num_shards if layout == "zigzag" else num_shards
    part = seq_len // parts
    extent = Extent(part, seq_len // num_shards, "zigzag half-shard" if layout == "zigzag" else "shard")
    good_s = -(-seq_len // (parts * NUM_LANES)) * parts * NUM_LANES
    return fit_blocks(
        config, q=extent, kv=extent,
        what=f"ring attention over {num_shards} devices (layout {layout!r}, S // {parts} = {seq_len} // {parts} = "
             f"{part} tokens per {extent.name})",
        length_hint=f"use S divisible by {parts} x {NUM_LANES} = {parts * NUM_LANES} (e.g. S={good_s})")


def ring_plan(mask: masks_lib.AnyMask, num_shards: int, layout: layouts.Layout, config: SplashConfig, *,
              q_shard_rows: tuple[int, ...] | None = None) -> RingPlan:
    """Host metadata of a ring (cached): O(non-empty blocks + S), never a dense S x S mask.

    Args:
        mask: the global ``(S, S)`` mask on original positions.
        num_shards: devices N on the ring axis.
        layout: token layout of the shards.
        config: ``SplashConfig``; its blocks are fitted to the shards (:func:`fit_ring_blocks`).
        q_shard_rows: None, or the q shards (ring devices) whose work lists to expand
            (``build_mask_info(q_shard_rows=)``; ``()`` = none: the plan's shapes, ``active``,
            partial blocks and pieces, as every process needs them, without any list).

    Plans live in the one bounded cache of host work (``ringsplash._internal.caches.factories``, emptied by
    ``rs.clear_caches()``, which also empties ``build_mask_info``'s).
    """
    seq_len = masks_lib.head_masks(mask)[0].shape[0]
    blocks = fit_ring_blocks(seq_len, num_shards, layout, config)
    dkv = None if config.backend == "xla" else blocks.block_shape_dkv
    rows = None if q_shard_rows is None else tuple(int(r) for r in q_shard_rows)
    mode = partial_mode(mask, config.backend, config.partial_tiles)
    key = (mask, int(num_shards), layout, blocks.block_shape, dkv, mode)
    plan = factories.get(("ring_plan", *key, rows), lambda: _ring_plan(*key, rows))
    if rows:  # a rows plan holds all a list-less one does (ring_attention's): keep it, no second build
        factories.get(("ring_plan", *key, ()), lambda: _listless(plan))
    return plan


def _listless(plan: RingPlan) -> RingPlan:
    """``plan`` without any list rows: what ``ring_plan(..., q_shard_rows=())`` builds."""
    def cut(info):
        if info is None:
            return None
        lists = {f: getattr(info, f)[:, :0] for f in ("q_block", "kv_block", "kind", "partial_index")}
        return dataclasses.replace(info, **lists, q_shard_rows=())

    return dataclasses.replace(plan, info=cut(plan.info), info_dkv=cut(plan.info_dkv))


def _ring_plan(mask, num_shards: int, layout: str, block_shape, block_shape_dkv, mode: str, rows=None) -> RingPlan:
    seq_len = masks_lib.head_masks(mask)[0].shape[0]
    perm = layouts.permutation(layout, seq_len, num_shards)
    # banded masks' partial tiles come from positions, as in single-device Splash (splash/partial_tiles.py)
    common = {"q_shards": num_shards, "kv_shards": num_shards, "q_positions": perm, "kv_positions": perm,
              "q_shard_rows": rows, "partial_mode": mode}
    if block_shape_dkv is None:
        info, info_dkv = build_mask_info(mask, block_shape, **common), None
    else:  # the two views are independent numpy work (mostly GIL-free): build them side by side
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            dkv = pool.submit(build_mask_info, mask, block_shape_dkv, transpose=True, **common)
            info, info_dkv = build_mask_info(mask, block_shape, **common), dkv.result()
    active = np.asarray(info.num_active).sum(0) > 0
    if info_dkv is not None:
        active = active | (np.asarray(info_dkv.num_active).sum(0) > 0)
    return RingPlan(info=info, info_dkv=info_dkv, positions=np.asarray(perm).reshape(num_shards, -1), active=active)


def ring_work(plan: RingPlan) -> np.ndarray:
    """Non-empty forward blocks of each (q shard, kv shard) pair, summed over the mask's lists:
    int64 ``[N, N]``."""
    return np.asarray(plan.info.num_active, np.int64).sum(0)


def critical_path(work: np.ndarray) -> int:
    """The ring's critical-path work: ``Σ_t max_a work[a, (a - t) mod N]`` (device ``a`` holds kv
    shard ``(a - t) mod N`` at step ``t``); ``work`` is ``[N, N]`` (:func:`ring_work`). Its ratio
    to ``work.sum() / N`` is the ring's balance (1 = ideal)."""
    work = np.asarray(work)
    n = work.shape[0]
    a = np.arange(n)
    return int(sum(work[a, (a - t) % n].max() for t in range(n)))


# ----------------------------------------------------------------------------------------
# the per-device schedule: a plan's work lists in SMEM-sized pieces, sharded over the ring axis


class ScheduleKey(NamedTuple):
    """What a :class:`RingSchedule` was built for (hashable; masks are values): a ring call with
    any other mask, shard count, layout, fitted blocks, backend view or head counts refuses the
    schedule (:func:`check_schedule`), as its work lists would silently run another mask."""

    mask: masks_lib.AnyMask  # the global (S, S) mask on original positions (its shape is S)
    num_shards: int
    layout: str
    block_shape: tuple[int, int]  # fitted forward / dq blocks
    block_shape_dkv: tuple[int, int] | None  # fitted dK/dV blocks; None: the xla backend (no dK/dV view)
    heads: int
    kv_heads: int
    partial_tiles: str = "auto"  # SplashConfig.partial_tiles: stored partial blocks name other list entries

    @classmethod
    def of(cls, mask, num_shards: int, layout: str, config: SplashConfig, heads: int, kv_heads: int) -> "ScheduleKey":
        """The key of a ring over ``num_shards`` devices with these arguments."""
        seq_len = masks_lib.head_masks(mask)[0].shape[0]
        blocks = fit_ring_blocks(seq_len, num_shards, layout, config)
        dkv = None if config.backend == "xla" else tuple(blocks.block_shape_dkv)
        return cls(mask, int(num_shards), str(layout), tuple(blocks.block_shape), dkv, int(heads), int(kv_heads),
                   config.partial_tiles)

    def differences(self, other: "ScheduleKey") -> list[str]:
        """``"field: built for X, this call has Y"`` for every field that differs."""
        out = []
        for name in self._fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: the schedule was built for {_short(mine)}, this call has {_short(theirs)}")
        return out


def _short(x, limit: int = 160) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """Work lists of a ring with their SMEM pieces: ``fwd`` / ``dkv`` are ``(q_block, kv_block,
    kind, partial_index, bounds)`` of the forward / dq view and of the transposed dK/dV view
    (None for the xla backend): the MaskInfo's arrays ``[lists, q_rows, N, steps]`` and the
    pieces' ``bounds`` ``[lists, q_rows, N, pieces, 2]`` (``work_pieces.SplitLists``); ``q_rows``
    is N for the whole schedule and 1 for one device's slice inside ``shard_map``. ``key``
    (static) is what it was built for (:class:`ScheduleKey`); a call with other arguments
    refuses it."""

    fwd: tuple
    dkv: tuple | None
    fwd_pieces: tuple[Piece, ...] = dataclasses.field(metadata={"static": True})
    dkv_pieces: tuple[Piece, ...] | None = dataclasses.field(metadata={"static": True})
    key: ScheduleKey | None = dataclasses.field(default=None, metadata={"static": True})

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


def schedule_from_splits(split: SplitLists, split_dkv: SplitLists | None, q_rows=None, *,
                         key: ScheduleKey) -> RingSchedule:
    """A numpy :class:`RingSchedule` of the q shards ``q_rows`` (None = all), built for ``key``."""
    rows = slice(None) if q_rows is None else np.asarray(q_rows)
    take = lambda sp: tuple(np.asarray(a)[:, rows] for a in (*sp.arrays, sp.bounds))
    return RingSchedule(
        fwd=take(split), dkv=None if split_dkv is None else take(split_dkv),
        fwd_pieces=split.pieces, dkv_pieces=None if split_dkv is None else split_dkv.pieces, key=key,
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


def ring_schedule(mask: masks_lib.AnyMask, num_shards: int, layout: layouts.Layout, config: SplashConfig, *,
                  heads: int, kv_heads: int, device_kind: str | None = None, mesh: jax.sharding.Mesh | None = None,
                  axis_name=None, shapes_only: bool = False, head_dim: int | None = None, dtype=None,
                  segment_ids: bool = False) -> RingSchedule:
    """The ring's work lists in SMEM-sized pieces, per q shard (see the module docstring).

    Pass the result to ``ring_attention(..., schedule=)`` as a ``shard_map`` operand sharded
    ``schedule.specs(axis_name)`` (``ring_attention_sharded`` does this), and to ``jit`` as an
    argument: each device then holds only its own q shard's rows.

    Args:
        mask: the global ``(S, S)`` mask on original positions.
        num_shards: devices N on the ring axis.
        layout: token layout of the shards.
        config: ``SplashConfig`` (blocks fitted to the shards; ``smem_budget_bytes``; backend).
        heads: q heads (the budget counts the prefetched head-to-list table).
        kv_heads: kv heads (the GQA walk of the dK/dV kernel).
        device_kind: the chip whose SMEM sets the budget (``jax.Device.device_kind``); None =
            the mesh's devices, else the default device.
        mesh: with ``axis_name``, return global ``jax.Array`` s sharded over the ring axis,
            building only the rows of this process's devices; None = numpy arrays, all rows.
        axis_name: the ring axis of ``mesh``.
        shapes_only: with ``mesh``: ``jax.ShapeDtypeStruct`` s (for AOT lowering), no arrays.
        head_dim, dtype, segment_ids: the calls' q head size and dtype (None: 128, bfloat16) and
            whether they pass segment ids: the blocks left at None are tuned for them
            (:func:`ring_config`), as the ring calls tune theirs.
    """
    num_shards, heads, kv_heads = (check_positive_int(n, x) for n, x in
                                   (("num_shards", num_shards), ("heads", heads), ("kv_heads", kv_heads)))
    check_divides("kv_heads", kv_heads, "heads", heads, hint="GQA groups")
    if device_kind is None and mesh is not None:
        device_kind = mesh.devices.flat[0].device_kind
    config = ring_config(config, mask, num_shards, head_dim=head_dim, dtype=dtype, segment_ids=segment_ids,
                         device_kind=device_kind)
    rows = None if mesh is None else process_rows(mesh, axis_name)
    if rows is not None and len(rows) < num_shards:  # a multi-host slice: this process's rows only
        return _process_schedule(mask, num_shards, layout, config, heads, kv_heads, device_kind, mesh, axis_name,
                                 shapes_only, rows)
    key = ScheduleKey.of(mask, num_shards, layout, config, heads, kv_heads)
    plan = ring_plan(mask, num_shards, layout, config)
    split, split_dkv = _ring_splits(plan, config, heads, kv_heads, device_kind)
    whole = schedule_from_splits(split, split_dkv, key=key)
    if mesh is None:
        return whole
    if shapes_only:
        return schedule_shapes(whole, mesh, axis_name)
    return schedule_arrays(lambda rows: schedule_from_splits(split, split_dkv, rows, key=key),
                           whole, mesh, axis_name)


def _process_schedule(mask, num_shards, layout, config, heads, kv_heads, device_kind, mesh, axis_name, shapes_only,
                      rows) -> RingSchedule:
    """``ring_schedule`` on a process holding only the ring devices ``rows``: the shapes and pieces
    come from a plan without lists (every process computes the same ones, as the program they all
    compile must agree), the arrays from a plan of this process's rows only."""
    whole, local = rows_schedule(mask, num_shards, layout, config, heads, kv_heads, device_kind,
                                  () if shapes_only else rows)
    if shapes_only:
        return schedule_shapes(whole, mesh, axis_name)
    at = {r: i for i, r in enumerate(rows)}

    def pick(want):  # one device's row: a view, not a copy of every leaf
        idx = [at[r] for r in want]
        sel = slice(idx[0], idx[0] + len(idx)) if idx == list(range(idx[0], idx[0] + len(idx))) else idx
        return jax.tree.map(lambda x: x[:, sel], local)

    return schedule_arrays(pick, whole, mesh, axis_name)


def rows_schedule(mask, num_shards, layout, config, heads, kv_heads, device_kind, rows):
    """``(whole, local)``: the whole schedule's ``ShapeDtypeStruct`` s and pieces (from a plan
    without lists, which ``ring_attention`` uses too) and the numpy schedule of the q shards
    ``rows`` (``[lists, len(rows), ...]``; None for ``()``). Every pair is classified once."""
    local = None
    key = ScheduleKey.of(mask, num_shards, layout, config, heads, kv_heads)
    if rows:  # first: the list-less plan then comes from this one
        plan = ring_plan(mask, num_shards, layout, config, q_shard_rows=rows)
        local = schedule_from_splits(*_ring_splits(plan, config, heads, kv_heads, device_kind), key=key)
    header = ring_plan(mask, num_shards, layout, config, q_shard_rows=())
    empty = schedule_from_splits(*_ring_splits(header, config, heads, kv_heads, device_kind), key=key)
    whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], num_shards, *x.shape[2:]), x.dtype), empty)
    return whole, local


def _ring_splits(plan: RingPlan, config: SplashConfig, heads: int, kv_heads: int, device_kind=None):
    budget = work_pieces.list_budget_bytes(config, device_kind)
    split = work_pieces.split_work_lists(plan.info, work_pieces.forward_max_steps(budget, plan.info, heads))
    split_dkv = None
    if plan.info_dkv is not None:
        steps = work_pieces.dkv_max_steps(budget, plan.info_dkv, heads, kv_heads)
        split_dkv = work_pieces.split_work_lists(plan.info_dkv, steps)
    return split, split_dkv


def check_schedule(schedule, plan: RingPlan, n: int, key: ScheduleKey) -> None:
    """Raise unless ``schedule`` was built for this call (``key``: mask, shards, layout, blocks,
    heads) and fits its plan (its own pieces are trusted: they come from :func:`ring_schedule`,
    whose budget may name another chip than this trace's)."""
    if not isinstance(schedule, RingSchedule):
        raise TypeError(f"schedule must be a RingSchedule (ring_schedule(...)), got {type(schedule).__name__}")
    if schedule.key is None:
        raise ValueError("schedule carries no key of the call it was built for: build it with ring_schedule(mask, "
                         "num_shards, layout, config, heads=..., kv_heads=...)")
    if schedule.key != key:
        raise ValueError(
            "schedule was built for another ring call (its work lists would run another mask): "
            + "; ".join(schedule.key.differences(key))
            + ". Build it with ring_schedule(...) for this call's mask, layout, shards, config and heads (and its "
              "head_dim, dtype and segment_ids, which pick the tuned blocks)"
        )
    views = [(schedule.fwd, schedule.fwd_pieces, plan.info)]
    if plan.info_dkv is not None:
        views.append((schedule.dkv, schedule.dkv_pieces, plan.info_dkv))
    for arrays, pieces, info in views:
        n_major = info.kv_blocks_per_shard if info.transpose else info.q_blocks_per_shard
        ok = arrays is not None and pieces and pieces[0].start == 0 and pieces[-1].stop == n_major
        ok = ok and all(a.stop == b.start for a, b in itertools.pairwise(pieces)) and len(arrays) == 5
        shapes = ((info.num_lists, 1, n), (info.num_lists, n, n))
        ok = ok and all(x.shape[:3] in shapes for x in arrays) and arrays[4].shape[3] == len(pieces)
        ok = ok and all(x.shape[3] == info.max_steps for x in arrays[:4])
        if not ok:
            raise ValueError(
                f"schedule does not match this ring call ({n} shards, {info.num_lists} lists, {n_major} "
                f"{'kv' if info.transpose else 'q'} blocks per shard): build it with ring_schedule(mask, num_shards, "
                f"layout, config, heads=..., kv_heads=...) for the same arguments and pass it sharded over the ring "
                f"axis (in_specs schedule.specs(axis_name))"
            )

