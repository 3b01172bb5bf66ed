"""Batches on the mesh. Every ``[batch, seq]`` field is padded to a length the strategy tiles
and permuted once, on the host, into the strategy's layout (``layout_batch``) and placed as
``batch_spec``; each process fills only its addressable shards, and ``stream_batch`` draws only
this process's rows. ``unlayout`` takes an output back to the caller's order and length."""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash import layouts
from ringsplash._internal.scalar_checks import check_divides, check_positive_int
from ringsplash.data import Batch, BatchSource, check_token_ids
from ringsplash.model import PAD_SEGMENT, TransformerConfig
from ringsplash.train.mesh import DATA, batch_spec


def pad_batch(batch: Batch, model_config: TransformerConfig) -> Batch:
    """``batch`` right-padded along the sequence to ``model_config.padded_seq_len(seq)``, the
    smallest length the strategy's layout and blocks tile (600 tokens over 4 zigzag shards, say;
    unchanged when ``seq`` tiles). Padding is inert: token and label 0, loss mask 0 (so every loss
    and its normalisation count real tokens only), positions continuing each row's last, and
    segment id ``PAD_SEGMENT``, which no real token may carry: no real query sees a padded key
    (``model.attend``), whatever the mask."""
    if not model_config.context_parallel.roles:
        return batch
    seg = np.asarray(batch.segment_ids)
    if seg.size and (seg.min() <= PAD_SEGMENT + 1):
        raise ValueError(f"segment_ids must be > {PAD_SEGMENT + 1} (the two lowest int32 values mark padding), "
                         f"got a minimum of {seg.min()}")
    seq = seg.shape[1]
    if seq > model_config.max_seq_len:
        raise ValueError(f"the batch has seq_len={seq} tokens, more than the model's max_seq_len="
                         f"{model_config.max_seq_len}: pass at most max_seq_len tokens, or build the model with a "
                         f"larger max_seq_len")
    pad = model_config.padded_seq_len(seq) - seq
    if not pad:
        return batch
    widen = lambda x, value: np.pad(np.asarray(x), ((0, 0), (0, pad)), constant_values=value)
    positions = np.asarray(batch.positions)
    after = positions[:, -1:] + 1 + np.arange(pad, dtype=positions.dtype)
    return Batch(widen(batch.tokens, 0), widen(batch.labels, 0), widen(batch.loss_mask, 0),
                 np.concatenate([positions, after], axis=1), widen(seg, PAD_SEGMENT))


def layout_batch(batch: Batch, model_config: TransformerConfig) -> Batch:
    """Pad (``pad_batch``) and permute every field along the sequence into the strategy's layout
    (``context_parallel.layout`` over ``layout_shards``: the ring degree for ring / all-gather / USP, the
    Ulysses degree for Ulysses); identity without context parallelism. ``unlayout`` undoes it on
    outputs."""
    cp = model_config.context_parallel
    if not cp.roles:
        return batch
    batch = pad_batch(batch, model_config)
    return Batch(*(layouts.permute(np.asarray(x), cp.layout, cp.layout_shards, axis=1) for x in batch))


def unlayout(x, model_config: TransformerConfig, seq_len: int, *, axis: int = 1) -> np.ndarray:
    """An output of a batch laid out by ``layout_batch`` (``[batch, padded, ...]``, e.g. the logits of
    ``make_logits_fn``) back in original order at the caller's ``seq_len``: unpermuted, the padding
    sliced off. Host side (numpy)."""
    check_positive_int("seq_len", seq_len)
    x = np.asarray(x)
    padded = model_config.padded_seq_len(seq_len)
    if x.shape[axis] != padded:
        raise ValueError(f"x has {x.shape[axis]} positions on axis {axis}, but a batch of seq_len={seq_len} tokens "
                         f"is laid out at {padded} (TransformerConfig.padded_seq_len): pass the batch's own seq_len")
    cp = model_config.context_parallel
    if cp.roles:
        x = layouts.unpermute(x, cp.layout, cp.layout_shards, axis=axis)
    return x.take(np.arange(seq_len), axis=axis)


def _global_array(x, sharding: NamedSharding) -> jax.Array:
    """A global array from a host copy every process holds (multi-host safe: each process
    fills only its addressable shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_batch(batch: Batch, mesh: jax.sharding.Mesh, model_config: TransformerConfig) -> Batch:
    """Layout (host) + place on the mesh as ``P("data", "context")``. Every process builds the
    same global batch (streams are deterministic) and contributes its own shards."""
    sharding = NamedSharding(mesh, batch_spec(model_config))
    return Batch(*(_global_array(x, sharding) for x in layout_batch(batch, model_config)))


def process_rows(mesh: jax.sharding.Mesh, batch_size: int) -> np.ndarray:
    """The global rows of a ``batch_size``-row batch (rows sharded over the mesh's ``"data"``
    axis, ``batch_spec``) that this process's devices hold shards of, ascending: all rows in a
    single-process run, or when the processes split the mesh along ``"context"`` only."""
    check_divides(DATA, mesh.shape[DATA], "batch_size", batch_size)
    per_shard = batch_size // mesh.shape[DATA]
    data_axis = mesh.axis_names.index(DATA)
    mine = sorted({idx[data_axis] for idx, d in np.ndenumerate(mesh.devices) if d.process_index == jax.process_index()})
    return np.concatenate([np.arange(i * per_shard, (i + 1) * per_shard) for i in mine])


def stream_batch(stream: BatchSource, step: int, mesh: jax.sharding.Mesh, model_config: TransformerConfig) -> Batch:
    """Batch ``step`` of ``stream`` on the mesh, as ``shard_batch(stream.batch(step), ...)`` places
    it, from this process's part only: the process draws (``stream.batch(step, rows=...)``) and
    lays out only the rows of ``process_rows`` and fills only its addressable shards. With a
    ``per_row`` stream no process touches another's rows; the global batch is the same whatever
    the number of processes. A token id outside the model's vocabulary is refused here
    (``data.check_token_ids``), naming the id and the batch."""
    rows = process_rows(mesh, stream.batch_size)
    local = stream.batch(step, rows=rows)
    check_token_ids(local, model_config.vocab_size, f"batch {step} of the data stream (seed {stream.seed})")
    return place_rows(local, rows, stream.batch_size, mesh, model_config)


def place_rows(local: Batch, rows: np.ndarray, batch_size: int, mesh: jax.sharding.Mesh,
               model_config: TransformerConfig) -> Batch:
    """The global ``batch_size``-row batch on the mesh from this process's rows ``rows``
    (``process_rows``; ``local`` holds them in that order): laid out and placed as
    ``shard_batch`` would place the whole batch, each process filling only its shards."""
    local = layout_batch(local, model_config)
    where = np.full(batch_size, -1)
    where[rows] = np.arange(len(rows))  # global row -> row of ``local``
    sharding = NamedSharding(mesh, batch_spec(model_config))

    def place(x: np.ndarray) -> jax.Array:
        shape = (batch_size, *x.shape[1:])
        return jax.make_array_from_callback(shape, sharding, lambda index: x[(where[index[0]], *index[1:])])

    return Batch(*(place(np.asarray(x)) for x in local))


def replicate(tree, mesh: jax.sharding.Mesh):
    """Every array leaf of ``tree`` replicated over the mesh."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _global_array(x, sharding) if eqx.is_array(x) else x, tree)
