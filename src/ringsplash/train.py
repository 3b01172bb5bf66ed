"""Training: AdamW with warmup + cosine, a data × context mesh, checkpoints, metrics, progress.

The mesh has axes ``("data", "context")``. Under ``attention="ring"`` the ring runs over
``"context"``: every ``[batch, seq]`` field of a batch (tokens, labels, loss mask, positions,
segment ids) is permuted **once**, on the host, into the model's ring layout and sharded as
``P("data", "context")``; the model then sees local shards of layout-ordered tokens with their
true positions. The all-gather strategy shards the same way over ``"context"``, Ulysses too (its all-to-all
runs over ``"context"``); USP adds a third axis, ``("data", "context", "ulysses")`` (``make_mesh(...,
ulysses=a)``): the ring across ``"context"``, Ulysses inside over ``"ulysses"``, batches permuted
over the ring degree and sharded ``P("data", ("context", "ulysses"))``. Reference and splash need
``context == 1``.

One train step = one ``shard_map`` over the mesh in which each device takes the gradient of its
own (unnormalised) loss; the ring's custom VJP returns every device the gradient of the
*total* loss through its local tokens, so a ``psum`` over both axes divided by the global
number of scored tokens is the exact gradient of the mean loss.

Parameters and AdamW state are sharded FSDP-style over ``("data", "context")`` when
``TrainConfig.fsdp`` (``ringsplash.partitioning``): the step receives local shards, gathers the
embedding / final norm / unembedding once and each layer's weights inside the scanned layer
step; the gradient of a sharded parameter comes back reduce-scattered (the all-gather's
transpose), already summed over the mesh. The loss projects hidden states to the vocabulary in
chunks of ``TrainConfig.loss_chunk`` tokens under ``jax.checkpoint`` (``chunked_loss_sums``),
so at most ``loss_chunk x vocab`` logits exist per device.

Ring schedule. Under ``attention="ring"`` / ``"usp"`` the step, eval and logits functions build the
ring's work lists once per sequence length on the host (``batch_ring_schedule``, cached; each process
only its devices' rows) and pass them into their ``jit`` as an argument sharded over the ring axis, so
each device holds its own q shard's rows, 1/N of the schedule, instead of the whole schedule as a
constant replicated on every device; every layer's ring reads the same lists.

Max logits and QK-clip. With ``TransformerConfig.qk_clip_threshold`` (or
``TrainConfig.log_max_logits``) the step collects every layer's per-head max attention logit
from its forward pass (the attention returns them, the layer scan stacks them, a ``pmax`` over
the mesh reduces them) into ``metrics["max_logits"]`` ``[num_layers, heads]``; with the
threshold set, after the optimiser update the W_q / W_k columns of the heads above it are
rescaled (``ringsplash.model.qk_clip``) — an elementwise op on the (possibly FSDP-sharded)
parameters, deterministic, so checkpoints and resumption need nothing extra. ``fit`` logs the
per-layer maxima (``max_logit/layer<i>``, max over heads) and the number of clipped heads.

Checkpoints (``ringsplash.checkpoints``: orbax, sharded, atomic) hold model, optimiser state, step and the data stream's
position; batches are a pure function of (seed, step), so a resumed run is bit-identical to an
uninterrupted one. ``fit`` restores straight into the plan's shardings (``restore_sharded_state``:
orbax reads each device's shard; no host holds the whole state), and each process draws and
places only the batch rows its devices hold (``stream_batch``).
"""

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ringsplash import checkpoints, layouts, partitioning
from ringsplash._checks import check_divides, check_int, check_positive_int
from ringsplash._types import Array, Float, Int
from ringsplash.data import Batch, DataStream
from ringsplash.model import Transformer, TransformerConfig
from ringsplash.model.config import dtype_of
from ringsplash.model.qk_clip import apply_qk_clip
from ringsplash.model.schedule import model_ring_schedule

DATA, CONTEXT = "data", "context"
ULYSSES = "ulysses"  # USP's inner (all-to-all) axis, present only when make_mesh(..., ulysses=a) asks for it


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule, parallelism and bookkeeping of one training run."""

    steps: int = 1000
    batch_size: int = 8  # global rows per step
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float | None = 1.0
    data_parallel: int = 1
    context_parallel: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    progress: bool = True
    fsdp: bool = True  # shard params + optimiser state over data x context (a no-op on one device)
    loss_chunk: int = 0  # tokens per chunk of the cross-entropy (0: all local tokens at once)
    ulysses_parallel: int = 1  # USP: devices on the mesh's "ulysses" axis (inside each of the context ring's members)
    log_max_logits: bool = False  # collect + log per-layer max logits (always on with qk_clip_threshold)

    def __post_init__(self):
        for name in ("steps", "batch_size", "data_parallel", "context_parallel", "log_every", "ulysses_parallel"):
            check_positive_int(name, getattr(self, name))
        check_divides("data_parallel", self.data_parallel, "batch_size", self.batch_size)
        if not 0 <= check_int("warmup_steps", self.warmup_steps) <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        check_int("loss_chunk", self.loss_chunk, minimum=0)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW on a linear-warmup + cosine-decay schedule (to ``min_lr_ratio * learning_rate``)."""
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip) if tc.grad_clip else optax.identity(),
        optax.adamw(learning_rate_schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay),
    )


def learning_rate_schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0, tc.learning_rate, max(tc.warmup_steps, 1), max(tc.steps, tc.warmup_steps + 2),
        tc.learning_rate * tc.min_lr_ratio,
    )


def make_mesh(data: int = 1, context: int = 1, devices=None, *, ulysses: int | None = None) -> jax.sharding.Mesh:
    """A ``(data, context)`` mesh over the first ``data * context`` devices; with ``ulysses``, a
    ``(data, context, ulysses)`` mesh over ``data * context * ulysses`` (for ``attention="usp"``:
    the ring over ``context``, the all-to-all over the innermost ``ulysses``)."""
    devices = jax.devices() if devices is None else devices
    if ulysses is not None:
        check_positive_int("ulysses", ulysses)
        context_total = context * ulysses
        mesh = make_mesh(data, context_total, devices)  # the same device checks, on data x (context x ulysses)
        return jax.make_mesh((data, context, ulysses), (DATA, CONTEXT, ULYSSES), devices=list(mesh.devices.flat),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)
    processes = jax.process_count()
    if processes > 1 and (data * context) % processes:
        raise ValueError(
            f"mesh data={data} x context={context} = {data * context} devices cannot be split evenly over "
            f"{processes} processes: use a mesh whose size is a multiple of the process count"
        )
    if processes > 1 and data * context != len(devices):
        raise ValueError(
            f"mesh data={data} x context={context} = {data * context} devices must use all {len(devices)} devices "
            f"of the {processes} processes (each process feeds its own devices' shards)"
        )
    if len(devices) < data * context:
        raise ValueError(
            f"mesh data={data} x context={context} needs {data * context} devices, found {len(devices)} "
            f"(on CPU set jax.config.update('jax_num_cpu_devices', N) before JAX starts)"
        )
    return jax.make_mesh(
        (data, context), (DATA, CONTEXT), devices=devices[: data * context],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def mesh_for(model_config: TransformerConfig, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """The trainer's mesh for ``model_config``'s strategy: ``(data, context)`` with ``context`` the
    ring / all-gather / Ulysses degree (1 for reference and splash), or ``(data, context, ulysses)``
    for USP (``ring_size`` x ``ulysses_size``)."""
    c = model_config
    if c.attention == "usp":
        return make_mesh(data, c.ring_size, devices, ulysses=c.ulysses_size)
    return make_mesh(data, c.context_shards, devices)


def _trainer_axes(model_config: TransformerConfig) -> dict[str, str]:
    """Config field -> the trainer mesh axis it must name, for the configured strategy."""
    return {"ring": {"ring_axis_name": CONTEXT}, "allgather": {"ring_axis_name": CONTEXT},
            "ulysses": {"ulysses_axis_name": CONTEXT},
            "usp": {"ring_axis_name": CONTEXT, "ulysses_axis_name": ULYSSES}}.get(model_config.attention, {})


def check_mesh(model_config: TransformerConfig, mesh: jax.sharding.Mesh) -> None:
    """The model's context-parallel axes must be the trainer mesh's axes, with the same sizes."""
    c, shape = model_config, dict(mesh.shape)
    fields = _trainer_axes(c)
    for field, axis in fields.items():
        if getattr(c, field) != axis:
            raise ValueError(f"the trainer runs attention={c.attention!r} over {axis!r}: set {field}={axis!r}")
        size_field = field.replace("axis_name", "size")
        if axis not in shape:
            raise ValueError(
                f"attention={c.attention!r} needs a {axis!r} mesh axis of {size_field}={getattr(c, size_field)} "
                f"devices; the mesh has {shape}: build it with train.make_mesh(data, context, ulysses=...)"
            )
    for field, axis in fields.items():
        size_field = field.replace("axis_name", "size")
        if getattr(c, size_field) != shape[axis]:
            raise ValueError(f"{size_field}={getattr(c, size_field)} must equal the mesh's {axis} axis ({shape[axis]})")
    for axis, flag in ((CONTEXT, "context_parallel"), (ULYSSES, "ulysses_parallel")):
        if shape.get(axis, 1) != 1 and axis not in fields.values():
            needs = "attention='usp'" if axis == ULYSSES else "attention='ring', 'allgather', 'ulysses' or 'usp'"
            raise ValueError(f"{flag}={shape[axis]} needs {needs} (or {flag}=1)")


def mesh_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """Every axis of the trainer's mesh: ``("data", "context")`` (plus ``"ulysses"`` for USP)."""
    return tuple(mesh.axis_names)


# ----------------------------------------------------------------------------- batches


def layout_batch(batch: Batch, model_config: TransformerConfig) -> Batch:
    """Permute every field along the sequence into the strategy's layout (``ring_layout`` over
    ``layout_shards``: the ring degree for ring / all-gather / USP, the Ulysses degree for
    Ulysses); identity without context parallelism."""
    if not _trainer_axes(model_config):
        return batch
    c = model_config
    return Batch(*(layouts.permute(np.asarray(x), c.ring_layout, c.layout_shards, axis=1) for x in batch))


def batch_spec(model_config: TransformerConfig) -> P:
    axes = tuple(_trainer_axes(model_config).values())  # USP: ring-major (context, ulysses)
    return P(DATA, None if not axes else axes[0] if len(axes) == 1 else axes)


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


def stream_batch(stream: DataStream, step: int, mesh: jax.sharding.Mesh, model_config: TransformerConfig) -> Batch:
    """Batch ``step`` of ``stream`` on the mesh, as ``shard_batch(stream.batch(step), ...)`` places
    it, from this process's part only: the process draws (``stream.batch(step, rows=...)``) and
    lays out only the rows of ``process_rows`` and fills only its addressable shards. With a
    ``per_row`` stream no process touches another's rows; the global batch is the same whatever
    the number of processes."""
    rows = process_rows(mesh, stream.batch_size)
    local = layout_batch(stream.batch(step, rows=rows), model_config)
    where = np.full(stream.batch_size, -1)
    where[rows] = np.arange(len(rows))  # global row -> row of ``local``
    sharding = NamedSharding(mesh, batch_spec(model_config))

    def place(x: np.ndarray) -> jax.Array:
        shape = (stream.batch_size, *x.shape[1:])
        return jax.make_array_from_callback(shape, sharding, lambda index: x[(where[index[0]], *index[1:])])

    return Batch(*(place(np.asarray(x)) for x in local))


def replicate(tree, mesh: jax.sharding.Mesh):
    """Every array leaf of ``tree`` replicated over the mesh."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _global_array(x, sharding) if eqx.is_array(x) else x, tree)


def place_state(model: Transformer, opt_state, mesh: jax.sharding.Mesh, plan: partitioning.ShardingPlan,
                optimizer: optax.GradientTransformation):
    """(model, opt_state) on the mesh laid out by ``plan`` (multi-host safe, from host copies)."""
    params, static = eqx.partition(model, eqx.is_array)
    param_sh = partitioning.shardings(plan.specs, mesh)
    opt_sh = partitioning.optimizer_shardings(optimizer, params, param_sh, mesh)
    place = lambda tree, sh: jax.tree.map(lambda x, s: _global_array(x, s), tree, sh)
    return eqx.combine(place(params, param_sh), static), place(opt_state, opt_sh)


# ----------------------------------------------------------------------------- loss and steps


def chunked_loss_sums(
    hidden: Float[Array, "tokens d_model"],
    unembedding: Float[Array, "d_model vocab"],
    labels: Int[Array, " tokens"],
    weights: Float[Array, " tokens"],
    loss_chunk: int = 0,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of weighted cross-entropy, sum of weighted correct predictions) over ``tokens``.

    With ``loss_chunk`` the tokens are taken ``loss_chunk`` at a time by a ``lax.scan`` whose
    body is ``jax.checkpoint``-ed: forward and backward each hold one chunk's ``[loss_chunk,
    vocab]`` float32 logits, never all of them. ``loss_chunk=0``: one pass over all tokens.

    Args:
        hidden: final hidden states of the local tokens.
        unembedding: the output projection (``Transformer.unembedding_matrix()``).
        labels: next-token ids.
        weights: loss weights (the loss mask).
        loss_chunk: tokens per chunk; must divide the number of tokens.
    """
    n = hidden.shape[0]

    def sums(h, y, w):
        logits = (h @ unembedding).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        return jnp.sum(ce * w), jnp.sum(correct * w)

    if not loss_chunk or loss_chunk == n:
        return sums(hidden, labels, weights)
    if n % loss_chunk:
        raise ValueError(
            f"loss_chunk={loss_chunk} must divide the number of local tokens per device ({n} = local rows x "
            f"local sequence length): pick a divisor of {n}"
        )
    chunks = n // loss_chunk

    @jax.checkpoint
    def body(carry, xs):
        s, c = sums(*xs)
        return (carry[0] + s, carry[1] + c), None

    xs = (hidden.reshape(chunks, loss_chunk, -1), labels.reshape(chunks, loss_chunk),
          weights.reshape(chunks, loss_chunk))
    (s, c), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), xs)
    return s, c


def _local_sums(model: Transformer, batch: Batch, key, *, loss_chunk: int = 0, gather_layer=None,
                max_logits: bool = False, schedule=None):
    """Per-device (unnormalised) loss sum, scored weight, correct weight (and with ``max_logits``
    the local rows' ``[num_layers, heads]`` max logits); ``schedule``: this device's ring schedule."""
    n = batch.tokens.shape[0]
    keys = None if key is None else jax.random.split(key, n)
    call = lambda t, p, s, k: model.hidden(t, p, s, key=k, gather_layer=gather_layer, return_max_logits=max_logits,
                                           schedule=schedule)
    hidden = jax.vmap(call)(batch.tokens, batch.positions, batch.segment_ids, keys)
    mx = ()
    if max_logits:  # [rows, layers, heads] -> this device's [layers, heads]
        hidden, rows_mx = hidden
        mx = (jnp.max(rows_mx, axis=0),)
    w = batch.loss_mask.astype(jnp.float32)
    s, c = chunked_loss_sums(hidden.reshape(-1, hidden.shape[-1]), model.unembedding_matrix(),
                             batch.labels.reshape(-1), w.reshape(-1), loss_chunk)
    return s, jnp.sum(w), c, *mx


def batch_ring_schedule(model_config: TransformerConfig, mesh, batch: Batch):
    """The model's ring schedule for ``batch``'s sequence length (``model.schedule.model_ring_schedule``,
    cached; ``ShapeDtypeStruct`` s for an abstract batch), or None when the strategy has no ring.
    The step functions pass it into their ``jit`` as an argument, so each device holds 1/N of it."""
    tokens = batch.tokens
    return model_ring_schedule(model_config, tokens.shape[-1], mesh,
                               shapes_only=isinstance(tokens, jax.ShapeDtypeStruct))


def _schedule_spec(model_config: TransformerConfig, schedule):
    """``shard_map`` spec of the schedule operand: each device takes its q shard's rows."""
    return None if schedule is None else schedule.specs(model_config.ring_axis_name)


def _device_key(key):
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, jax.lax.axis_index(DATA)), jax.lax.axis_index(CONTEXT))


FSDP_AXES = (DATA, CONTEXT)  # (+ ULYSSES on a USP mesh: sharding_plan shards over every mesh axis)


def sharding_plan(model_config: TransformerConfig, mesh, fsdp: bool) -> partitioning.ShardingPlan:
    """How the model's parameters (and so the optimiser state) are laid out on ``mesh``: FSDP over
    ``("data", "context")`` (stacked layer axes kept whole) or replicated."""
    model = eqx.filter_eval_shape(Transformer, model_config, key=jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return partitioning.plan_sharding(params, dict(mesh.shape), fsdp=fsdp, axes=mesh_axes(mesh),
                                      stacked=lambda path: path.startswith("layers."))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _gathered(p, plan: partitioning.ShardingPlan, dtype):
    """Inside ``shard_map``, on local shards laid out by a sharded ``plan``: (the parameters with
    every non-layer leaf gathered, a function gathering one layer's weights inside the scanned
    layer step)."""
    outer = eqx.tree_at(lambda s: s.layers, plan.specs,
                        replace_fn=lambda t: jax.tree.map(lambda _: P(), t, is_leaf=_is_spec))
    layer_specs = partitioning.unstacked(plan.specs.layers)
    gather_layer = lambda layer: partitioning.gather(layer, layer_specs, plan.axes, dtype=dtype)
    return partitioning.gather(p, outer, plan.axes, dtype=dtype), gather_layer


def make_grad_fn(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None,
                 loss_chunk: int = 0, max_logits: bool = False):
    """``grad_fn(params, static, batch, key, schedule=None) -> (grads, metrics)``: exact gradient
    of the mean loss over the whole (sharded) batch, as a ``shard_map`` over the mesh (not jitted).
    ``schedule``: ``batch_ring_schedule(model_config, mesh, batch)``, passed by the caller's
    ``jit`` as an argument (each device then holds its rows); None = each ring bakes the whole
    schedule in as a constant replicated on every device.

    Args:
        model_config: the model's config (checked against ``mesh``).
        mesh: the ``(data, context)`` mesh.
        plan: parameter layout (``sharding_plan``); ``None`` or unsharded: replicated
            parameters. Sharded: ``params`` are sharded by ``plan.specs`` and so are the grads.
        loss_chunk: tokens per chunk of the cross-entropy (0: unchunked).
        max_logits: also ``metrics["max_logits"]``: float32 ``[num_layers, heads]`` max attention
            logits of this forward pass over the whole batch (``pmax`` over the mesh).
    """
    check_mesh(model_config, mesh)
    axes = mesh_axes(mesh)
    dropout = model_config.attention_dropout > 0
    spec = batch_spec(model_config)
    sharded = plan is not None and plan.sharded
    cdt = dtype_of(model_config.compute_dtype)

    def gathered(p):
        """(params with non-layer leaves gathered, gather function for one layer)."""
        return _gathered(p, plan, cdt) if sharded else (p, None)

    def local(params, static, batch, key, schedule=None):
        def loss(p):
            p, gather_layer = gathered(p)
            s, w, c, *mx = _local_sums(eqx.combine(p, static), batch, _device_key(key) if dropout else None,
                                       loss_chunk=loss_chunk, gather_layer=gather_layer, max_logits=max_logits,
                                       schedule=schedule)
            return s, (w, c, *mx)

        (s, (w, c, *mx)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        total = jnp.maximum(jax.lax.psum(w, axes), 1e-9)
        if sharded:  # sharded leaves arrive reduce-scattered (summed over the mesh) already
            grads = jax.tree.map(lambda g, sp: (g if partitioning.is_sharded(sp) else jax.lax.psum(g, axes)) / total,
                                 grads, plan.specs)
        else:
            grads = jax.tree.map(lambda g: jax.lax.psum(g, axes) / total, grads)
        metrics = {"loss": jax.lax.psum(s, axes) / total, "accuracy": jax.lax.psum(c, axes) / total}
        if max_logits:
            metrics["max_logits"] = jax.lax.pmax(mx[0], axes)
        return grads, metrics

    param_spec = plan.specs if sharded else P()

    def grad_fn(params, static, batch, key=None, schedule=None):
        return jax.shard_map(
            lambda p, b, k, sc: local(p, static, b, k, sc), mesh=mesh,
            in_specs=(param_spec, Batch(*(spec,) * len(Batch._fields)), P(), _schedule_spec(model_config, schedule)),
            out_specs=(param_spec, P()), check_vma=False,
        )(params, batch, key, schedule)

    return grad_fn


def make_train_step(model_config: TransformerConfig, optimizer: optax.GradientTransformation, mesh, *,
                    plan: partitioning.ShardingPlan | None = None, loss_chunk: int = 0, max_logits: bool = False):
    """``step(model, opt_state, batch, key) -> (model, opt_state, metrics)`` (jitted). With a
    sharded ``plan`` the new parameters and optimiser state keep the plan's shardings. With
    ``model_config.qk_clip_threshold`` (or ``max_logits``) ``metrics["max_logits"]`` holds the
    step's ``[num_layers, heads]`` max logits; with the threshold the updated W_q / W_k are then
    QK-clipped with them (``ringsplash.model.qk_clip``) and ``metrics["qk_clipped_heads"]``
    counts the heads clipped. Under a ring the step builds the model's ring schedule once per
    sequence length (``batch_ring_schedule``) and passes it into its ``jit`` as an argument."""
    threshold = model_config.qk_clip_threshold
    max_logits = max_logits or threshold is not None
    grad_fn = make_grad_fn(model_config, mesh, plan=plan, loss_chunk=loss_chunk, max_logits=max_logits)
    sharded = plan is not None and plan.sharded

    @eqx.filter_jit(donate="all-except-first")
    def jitted(model_and_schedule, opt_state, batch, key):  # the cached schedule rides first: never donated
        model, schedule = model_and_schedule
        params, static = eqx.partition(model, eqx.is_array)
        grads, metrics = grad_fn(params, static, batch, key, schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        params = optax.apply_updates(params, updates)
        if threshold is not None:  # after the update, with this step's forward-pass maxima
            params = apply_qk_clip(params, metrics["max_logits"], threshold)
            metrics["qk_clipped_heads"] = jnp.sum(metrics["max_logits"] > threshold)
        if sharded:
            param_sh = partitioning.shardings(plan.specs, mesh)
            opt_sh = partitioning.optimizer_shardings(optimizer, params, param_sh, mesh)
            params = jax.lax.with_sharding_constraint(params, param_sh)
            opt_state = jax.lax.with_sharding_constraint(opt_state, opt_sh)
        return eqx.combine(params, static), opt_state, metrics

    def step(model, opt_state, batch, key):
        return jitted((model, batch_ring_schedule(model_config, mesh, batch)), opt_state, batch, key)

    # AOT: ``step.lower(model, opt_state, batch, key)`` lowers the same program (schedule included)
    step.lower = lambda model, opt_state, batch, key: jitted.lower(
        (model, batch_ring_schedule(model_config, mesh, batch)), opt_state, batch, key)
    return step


def make_eval_step(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None,
                   loss_chunk: int = 0):
    """``evaluate(model, batch) -> (loss_sum, weight, correct)`` summed over the mesh (jitted).

    Args:
        model_config: the model's config (checked against ``mesh``).
        mesh: the ``(data, context)`` mesh.
        plan: parameter layout (``sharding_plan``; the one the model was trained in). Sharded:
            each device takes its parameter shards and gathers the weights as the train step
            does (one layer at a time inside the scanned layer step), so no device ever holds a
            replicated copy of the model. ``None`` or unsharded: replicated parameters.
        loss_chunk: tokens per chunk of the cross-entropy (0: unchunked).
    """
    check_mesh(model_config, mesh)
    axes = mesh_axes(mesh)
    spec = batch_spec(model_config)
    sharded = plan is not None and plan.sharded
    cdt = dtype_of(model_config.compute_dtype)

    @eqx.filter_jit
    def jitted(model, batch, schedule):
        params, static = eqx.partition(model, eqx.is_array)

        def local(p, b, sc):
            p, gather_layer = _gathered(p, plan, cdt) if sharded else (p, None)
            sums = _local_sums(eqx.combine(p, static), b, None, loss_chunk=loss_chunk, gather_layer=gather_layer,
                               schedule=sc)
            return tuple(jax.lax.psum(x, axes) for x in sums)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(plan.specs if sharded else P(), Batch(*(spec,) * len(Batch._fields)),
                                        _schedule_spec(model_config, schedule)),
            out_specs=P(), check_vma=False,
        )(params, batch, schedule)

    def evaluate(model, batch):
        return jitted(model, batch, batch_ring_schedule(model_config, mesh, batch))

    return evaluate


def make_logits_fn(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None):
    """``logits(model, batch) -> [batch, seq, vocab]`` in the layout order of ``batch`` (jitted).
    ``plan``: the parameters' layout, as for ``make_eval_step`` (sharded: never replicated)."""
    check_mesh(model_config, mesh)
    spec = batch_spec(model_config)
    sharded = plan is not None and plan.sharded
    cdt = dtype_of(model_config.compute_dtype)

    @eqx.filter_jit
    def jitted(model, batch, schedule):
        params, static = eqx.partition(model, eqx.is_array)

        def local(p, b, sc):
            p, gather_layer = _gathered(p, plan, cdt) if sharded else (p, None)
            m = eqx.combine(p, static)
            hidden = lambda t, q, s: m.hidden(t, q, s, gather_layer=gather_layer, schedule=sc)
            return (jax.vmap(hidden)(b.tokens, b.positions, b.segment_ids) @ m.unembedding_matrix()).astype(
                jnp.float32)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(plan.specs if sharded else P(), Batch(*(spec,) * len(Batch._fields)),
                                        _schedule_spec(model_config, schedule)),
            out_specs=P(*spec, None), check_vma=False,
        )(params, batch, schedule)

    def logits(model, batch):
        return jitted(model, batch, batch_ring_schedule(model_config, mesh, batch))

    return logits


def evaluate(model, stream: DataStream, num_batches: int, mesh, model_config: TransformerConfig, eval_step=None,
             *, plan: partitioning.ShardingPlan | None = None):
    """Mean loss and accuracy (weighted by the loss mask) over ``num_batches`` of ``stream``
    (each process drawing only its rows, ``stream_batch``). ``plan``: the parameters' layout
    for the default ``eval_step`` (``make_eval_step``)."""
    eval_step = eval_step or make_eval_step(model_config, mesh, plan=plan)
    s = w = c = 0.0
    for i in range(num_batches):
        ls, lw, lc = eval_step(model, stream_batch(stream, i, mesh, model_config))
        s, w, c = s + float(ls), w + float(lw), c + float(lc)
    return {"loss": s / max(w, 1e-9), "accuracy": c / max(w, 1e-9)}


# ----------------------------------------------------------------------------- state and checkpoints


class TrainState(NamedTuple):
    model: Transformer
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: steps done = index of the next batch of the data stream
    data_seed: jax.Array  # int32 scalar: the data stream's seed


def init_state(model_config: TransformerConfig, tc: TrainConfig, data_seed: int = 0) -> TrainState:
    model = Transformer(model_config, key=jax.random.key(tc.seed))
    opt_state = make_optimizer(tc).init(eqx.filter(model, eqx.is_array))
    return TrainState(model, opt_state, jnp.asarray(0, jnp.int32), jnp.asarray(data_seed, jnp.int32))


def _is_struct(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def abstract_state(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                   plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """The ``TrainState`` that ``fit`` trains, with no array allocated: parameters and optimiser
    state as ``jax.ShapeDtypeStruct``s carrying their shardings on ``mesh`` (parameters and AdamW
    moments laid out by ``plan``, other optimiser leaves replicated), step and data seed as numpy
    scalars (every process holds them). The target of a sharded restore (``restore_sharded_state``)."""
    optimizer = make_optimizer(tc)
    model = eqx.filter_eval_shape(Transformer, model_config, key=jax.random.key(tc.seed))
    params, static = eqx.partition(model, _is_struct)
    param_sh = partitioning.shardings(plan.specs, mesh)
    opt_sh = partitioning.optimizer_shardings(optimizer, params, param_sh, mesh)
    with_sharding = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    params = jax.tree.map(with_sharding, params, param_sh)
    opt_state = jax.tree.map(with_sharding, jax.eval_shape(optimizer.init, params), opt_sh)
    return TrainState(eqx.combine(params, static), opt_state, np.asarray(0, np.int32),
                      np.asarray(data_seed, np.int32))


def restore_sharded_state(path: str, model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                          plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """The latest checkpoint under ``path`` restored straight into the shardings of
    ``abstract_state`` (the saving mesh and process count may differ): orbax reads each
    device's shard into place; no unsharded copy of the state is made on any host. Collective."""
    state = checkpoints.restore_state(path, abstract_state(model_config, tc, mesh, plan, data_seed))
    return state._replace(step=jnp.asarray(state.step, jnp.int32), data_seed=jnp.asarray(state.data_seed, jnp.int32))


def save_checkpoint(path: str, state: TrainState, *, config: dict | None = None, keep: int | None = 3) -> None:
    """Save ``state`` as checkpoint ``state.step`` under the directory ``path`` (sharded, atomic,
    orbax; see ``ringsplash.checkpoints``). Collective: every process calls it. A step already
    saved is not written again (batches are a pure function of (seed, step), so it is the same
    state); only the newest ``keep`` checkpoints are kept."""
    if int(state.step) in checkpoints.all_steps(path):
        return
    checkpoints.save_state(path, state, config=config, keep=keep)


def load_checkpoint(path: str, like: TrainState) -> TrainState:
    """Restore the latest checkpoint under ``path`` into the structure, static fields and
    shardings of ``like`` (arrays or ``jax.ShapeDtypeStruct``s; the mesh may differ from the
    saving one). Collective."""
    return checkpoints.restore_state(path, like)


def _sync_processes(name: str) -> None:
    """A barrier across processes (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def state_digest(state: TrainState) -> str:
    """sha256 (hex) of every array of ``state`` (parameters, optimiser state, step) in tree order:
    equal digests mean bit-identical states, whatever their sharding or process count."""
    import hashlib

    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(eqx.filter((state.model, state.opt_state, state.step), eqx.is_array)):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        x = np.asarray(leaf)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def check_run_config(path: str, config: dict, ignore: tuple[str, ...] = ()) -> None:
    """Write ``config`` (JSON) to ``path``, or, if ``path`` exists (a run being resumed), check that
    it holds the same config: a ``ValueError`` names every differing field (``ignore``: fields that
    may change between a run and its resumption, e.g. progress display)."""
    current = json.loads(json.dumps(config))  # tuples -> lists, as stored
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        diff = sorted(_config_diff(stored, current, ignore))
        if diff:
            raise ValueError(
                f"{path} was written by a run with a different config; resuming it needs the same one. "
                "Differing fields (stored vs given): " + "; ".join(f"{k}: {a!r} vs {b!r}" for k, a, b in diff)
            )
    if jax.process_index() == 0:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(current, f, indent=1)
        os.replace(tmp, path)


def _config_diff(stored, current, ignore, prefix=""):
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return [] if stored == current else [(prefix.rstrip("."), stored, current)]
    out = []
    for k in sorted(set(stored) | set(current)):
        name = prefix + k
        if name in ignore:
            continue
        missing = "<missing>"
        out += _config_diff(stored.get(k, missing), current.get(k, missing), ignore, name + ".")
    return out


# ----------------------------------------------------------------------------- metrics


class MetricsLog:
    """Append-only JSONL of step metrics plus a PNG plot (loss, accuracy, tokens/s, and the
    max attention logit per layer when the records have ``max_logit/layer<i>``)."""

    def __init__(self, run_dir: str, name: str = "metrics"):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, f"{name}.jsonl")
        self.plot_path = os.path.join(run_dir, f"{name}.png")

    def write(self, record: dict) -> None:
        """Append ``record`` (process 0 only: every process computes the same metrics)."""
        if jax.process_index() != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def truncate(self, after_step: int) -> None:
        """Drop every record past ``after_step`` (those of an interrupted run beyond its last
        checkpoint, which the resumed run writes again). Atomic: temp file, then rename."""
        if not os.path.exists(self.path):
            return
        keep = [r for r in self.read() if r.get("step", 0) <= after_step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot(self, title: str = "") -> str:
        """Write the PNG (process 0 only) and return its path."""
        if jax.process_index() != 0:
            return self.plot_path
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.read()
        train = [r for r in records if r.get("split", "train") == "train"]
        held = [r for r in records if r.get("split") == "eval"]
        layer_keys = sorted({k for r in train for k in r if k.startswith("max_logit/")},
                            key=lambda k: int(k.rsplit("layer", 1)[-1]))
        fig, axes = plt.subplots(1, 4 if layer_keys else 3, figsize=(20 if layer_keys else 15, 4))
        if layer_keys:  # max attention logit per layer (QK-clip statistics)
            for k in layer_keys:
                axes[3].plot([r["step"] for r in train if k in r], [float(r[k]) for r in train if k in r],
                             label=k.split("/", 1)[1])
            axes[3].set_xlabel("step")
            axes[3].set_title("max attention logit")
            axes[3].grid(alpha=0.3)
            axes[3].legend()
        for ax, key, label in zip(axes, ("loss", "accuracy", "tokens_per_s"), ("loss", "accuracy", "tokens / s")):
            xs = [r["step"] for r in train if key in r]
            ax.plot(xs, [r[key] for r in train if key in r], label="train")
            ev = [r for r in held if key in r]
            if ev:
                ax.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", label="held-out")
            ax.set_xlabel("step")
            ax.set_title(label)
            ax.grid(alpha=0.3)
            if ev:
                ax.legend()
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
        return self.plot_path


def max_logit_metrics(metrics: dict) -> dict:
    """``max_logit/layer<i>`` (max over heads) and ``qk_clipped_heads`` from step metrics."""
    if "max_logits" not in metrics:
        return {}
    per_layer = np.max(np.asarray(metrics["max_logits"]), axis=-1)
    out = {f"max_logit/layer{i}": float(x) for i, x in enumerate(per_layer)}
    if "qk_clipped_heads" in metrics:
        out["qk_clipped_heads"] = int(metrics["qk_clipped_heads"])
    return out


def _plain(v):
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# ----------------------------------------------------------------------------- the loop


def fit(
    model_config: TransformerConfig,
    tc: TrainConfig,
    stream: DataStream,
    run_dir: str,
    *,
    mesh=None,
    resume: bool = True,
    stop_after: int | None = None,
    on_log: Callable[[TrainState, dict], dict | None] | None = None,
) -> TrainState:
    """Train for ``tc.steps`` steps (resuming from the latest checkpoint under ``run_dir/checkpoints``).

    Resuming is exact: the checkpoint holds parameters, optimiser state and step; batches and
    dropout keys are pure functions of (seed, step). ``run_dir/config.json`` must match the
    given configs (else a ``ValueError`` names the differing fields), and metrics records past
    the checkpoint's step (written before an interruption) are dropped, so no step appears twice.
    A checkpoint is written every ``tc.checkpoint_every`` steps and at the end, atomically.

    ``stop_after`` stops early after that many total steps (for tests of exact resumption);
    ``on_log(state, record)`` may return extra metrics (e.g. a held-out evaluation) to log.
    """
    from tqdm.auto import tqdm

    usp = model_config.attention == "usp" or tc.ulysses_parallel > 1
    mesh = mesh or make_mesh(tc.data_parallel, tc.context_parallel, ulysses=tc.ulysses_parallel if usp else None)
    optimizer = make_optimizer(tc)
    plan = sharding_plan(model_config, mesh, tc.fsdp)
    step_fn = make_train_step(model_config, optimizer, mesh, plan=plan, loss_chunk=tc.loss_chunk,
                              max_logits=tc.log_max_logits)
    ckpt = os.path.join(run_dir, "checkpoints")
    log = MetricsLog(run_dir)
    # A resumed run must be the run that wrote the checkpoint (checked before loading it);
    # bookkeeping fields may change.
    config_path = os.path.join(run_dir, "config.json")
    if not resume and os.path.exists(config_path) and jax.process_index() == 0:
        os.remove(config_path)  # a fresh start may change the config
    _sync_processes("fresh run directory")
    check_run_config(config_path,
                     {"model": model_config.to_dict(), "train": dataclasses.asdict(tc), "data_seed": stream.seed},
                     ignore=("train.progress", "train.checkpoint_every", "train.log_every"))
    if resume and checkpoints.latest_step(ckpt) is not None:
        # straight into the plan's shardings: each device reads its shards, no host holds the whole state
        state = restore_sharded_state(ckpt, model_config, tc, mesh, plan, stream.seed)
        if int(state.data_seed) != stream.seed:
            raise ValueError(f"checkpoint {ckpt} was written with data seed {int(state.data_seed)}, not {stream.seed}")
        model, opt_state = state.model, state.opt_state
    else:
        state = init_state(model_config, tc, stream.seed)
        model, opt_state = place_state(state.model, state.opt_state, mesh, plan, optimizer)
    start = int(state.step)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    if jax.process_index() == 0:
        log.truncate(after_step=start)  # no duplicate steps: records past the checkpoint are rewritten
    _sync_processes("run directory ready")  # nobody reads config.json / metrics while process 0 rewrites them
    schedule = learning_rate_schedule(tc)
    base_key = jax.random.key(tc.seed + 1)
    tokens_per_step = tc.batch_size * model_config.max_seq_len

    bar = tqdm(total=end, initial=start, desc="train", disable=not tc.progress or jax.process_index() != 0,
               dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    next_batch = stream_batch(stream, start, mesh, model_config) if start < end else None
    for i in range(start, end):
        batch = next_batch
        model, opt_state, metrics = step_fn(model, opt_state, batch, jax.random.fold_in(base_key, i))
        if i + 1 < end:  # build the next batch on the host while the device works
            next_batch = stream_batch(stream, i + 1, mesh, model_config)
        window_steps += 1
        last = i + 1 == end
        if (i + 1) % tc.log_every == 0 or last or i == start:
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            record = {"split": "train", "step": i + 1, "loss": float(metrics["loss"]),
                      "accuracy": float(metrics["accuracy"]), "grad_norm": float(metrics["grad_norm"]),
                      "lr": float(schedule(i)), "time": now}
            record.update(max_logit_metrics(metrics))
            if i > start:  # the first step includes compilation
                record["tokens_per_s"] = window_steps * tokens_per_step / (now - window_start)
            window_start, window_steps = now, 0
            state = TrainState(model, opt_state, jnp.asarray(i + 1, jnp.int32), state.data_seed)
            if on_log is not None:
                record.update(on_log(state, record) or {})
            log.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}",
                            tok_s=f"{record.get('tokens_per_s', 0):.0f}")
        bar.update(1)
        if tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and not last:
            save_checkpoint(ckpt, TrainState(model, opt_state, jnp.asarray(i + 1, jnp.int32), state.data_seed))
    bar.close()
    state = TrainState(model, opt_state, jnp.asarray(max(end, start), jnp.int32), state.data_seed)
    save_checkpoint(ckpt, state)
    return state
