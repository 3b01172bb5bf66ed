"""The train, eval and logits steps: one ``shard_map`` over the mesh in which each device sums
its own (unnormalised) loss over its local tokens, projected to the vocabulary in chunks
(``chunked_loss_sums``); a ``psum`` divided by the global number of scored tokens gives the exact
mean. Parameters may be FSDP-sharded (``sharding_plan``) and are gathered inside the step.
Batches come laid out by ``train.batches`` (padded to a length the strategy tiles, the padding
unscored), so the steps take any sequence length and their losses count real tokens only."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ringsplash import partitioning
from ringsplash._internal.types import Array, Float, Int
from ringsplash.data import Batch, BatchSource
from ringsplash.model import Transformer, TransformerConfig, abstract_model
from ringsplash.model.config import dtype_of
from ringsplash.model.qk_clip import apply_qk_clip
from ringsplash.model.schedule import model_ring_schedule, schedule_specs
from ringsplash.model.transformer import soft_cap
from ringsplash.train.batches import stream_batch
from ringsplash.train.mesh import CONTEXT, DATA, batch_spec, check_mesh, mesh_axes


def chunked_loss_sums(
    hidden: Float[Array, "tokens d_model"],
    unembedding: Float[Array, "d_model vocab"],
    labels: Int[Array, " tokens"],
    weights: Float[Array, " tokens"],
    loss_chunk: int = 0,
    logit_soft_cap: float | None = None,
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
        logit_soft_cap: the model's ``final_logit_soft_cap`` (None: none), applied to each chunk's logits.
    """
    n = hidden.shape[0]

    def sums(h, y, w):
        logits = soft_cap((h @ unembedding).astype(jnp.float32), logit_soft_cap)
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
    cap = model.config.features.final_logit_soft_cap
    s, c = chunked_loss_sums(hidden.reshape(-1, hidden.shape[-1]), model.unembedding_matrix(),
                             batch.labels.reshape(-1), w.reshape(-1), loss_chunk, cap)
    return s, jnp.sum(w), c, *mx


def batch_ring_schedule(model_config: TransformerConfig, mesh, batch: Batch):
    """The model's ring schedule for ``batch``'s sequence length (``model.schedule.model_ring_schedule``,
    cached; ``ShapeDtypeStruct`` s for an abstract batch), or None when the strategy has no ring.
    The step functions pass it into their ``jit`` as an argument, so each device holds 1/N of it."""
    tokens = batch.tokens
    return model_ring_schedule(model_config, tokens.shape[-1], mesh,
                               shapes_only=isinstance(tokens, jax.ShapeDtypeStruct),
                               segment_ids=batch.segment_ids is not None)


def _schedule_spec(model_config: TransformerConfig, schedule):
    """``shard_map`` spec of the schedule operand: each device takes its q shard's rows."""
    return schedule_specs(schedule, model_config.context_parallel.ring_axis)


def _batch_specs(model_config: TransformerConfig) -> Batch:
    """``shard_map`` spec of a batch: every field as ``batch_spec``."""
    return Batch(*(batch_spec(model_config),) * len(Batch._fields))


def _device_key(key):
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, jax.lax.axis_index(DATA)), jax.lax.axis_index(CONTEXT))


def sharding_plan(model_config: TransformerConfig, mesh, fsdp: bool) -> partitioning.ShardingPlan:
    """How the model's parameters (and so the optimiser state) are laid out on ``mesh``: FSDP over
    every mesh axis (stacked layer axes kept whole) or replicated."""
    return partitioning.plan_model_sharding(abstract_model(model_config), mesh, fsdp=fsdp)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _gathered(p, plan: partitioning.ShardingPlan | None, dtype):
    """Inside ``shard_map``, on local parameters: (the parameters with every non-layer leaf gathered,
    a function gathering one layer's weights inside the scanned layer step); unchanged and None
    unless ``plan`` is sharded."""
    if plan is None or not plan.sharded:
        return p, None
    outer = eqx.tree_at(lambda s: s.layers, plan.specs,
                        replace_fn=lambda t: jax.tree.map(lambda _: P(), t, is_leaf=_is_spec))
    layer_specs = partitioning.unstacked(plan.specs.layers)
    gather_layer = lambda layer: partitioning.gather(layer, layer_specs, plan.axes, dtype=dtype)
    return partitioning.gather(p, outer, plan.axes, dtype=dtype), gather_layer


def _param_spec(plan: partitioning.ShardingPlan | None):
    return plan.specs if plan is not None and plan.sharded else P()


def make_grad_fn(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None,
                 loss_chunk: int = 0, max_logits: bool = False):
    """``grad_fn(params, static, batch, key, schedule=None) -> (grads, metrics)``: exact gradient
    of the mean loss over the whole (sharded) batch, as a ``shard_map`` over the mesh (not jitted).
    Each device differentiates its own unnormalised loss sum; the context-parallel attention's VJP
    returns every device the gradient of the total loss through its local tokens, so a ``psum``
    divided by the global number of scored tokens is exact. ``schedule``:
    ``batch_ring_schedule(model_config, mesh, batch)``, passed by the caller's ``jit`` as an
    argument (each device then holds its rows); None = each ring bakes the whole schedule in as a
    constant replicated on every device.

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
    sharded = plan is not None and plan.sharded
    cdt = dtype_of(model_config.compute_dtype)

    def local(params, static, batch, key, schedule=None):
        def loss(p):
            p, gather_layer = _gathered(p, plan, cdt)
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

    param_spec = _param_spec(plan)

    def grad_fn(params, static, batch, key=None, schedule=None):
        return jax.shard_map(
            lambda p, b, k, sc: local(p, static, b, k, sc), mesh=mesh,
            in_specs=(param_spec, _batch_specs(model_config), P(), _schedule_spec(model_config, schedule)),
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
    sequence length (``batch_ring_schedule``) and passes it into its ``jit`` as an argument;
    ``step.lower(model, opt_state, batch, key)`` lowers the same program (AOT)."""
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

    step.lower = lambda model, opt_state, batch, key: jitted.lower(
        (model, batch_ring_schedule(model_config, mesh, batch)), opt_state, batch, key)
    return step


def _sharded_apply(model_config: TransformerConfig, mesh, plan: partitioning.ShardingPlan | None, body, out_specs):
    """``apply(model, batch)`` (jitted): ``body(model, batch, gather_layer, schedule)`` on each
    device's local batch shards inside one ``shard_map``, the parameters taken as laid out by
    ``plan`` (gathered as the train step does) and the ring schedule passed as a sharded argument."""
    check_mesh(model_config, mesh)
    cdt = dtype_of(model_config.compute_dtype)

    @eqx.filter_jit
    def jitted(model, batch, schedule):
        params, static = eqx.partition(model, eqx.is_array)

        def local(p, b, sc):
            p, gather_layer = _gathered(p, plan, cdt)
            return body(eqx.combine(p, static), b, gather_layer, sc)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(_param_spec(plan), _batch_specs(model_config),
                                        _schedule_spec(model_config, schedule)),
            out_specs=out_specs, check_vma=False,
        )(params, batch, schedule)

    def apply(model, batch):
        return jitted(model, batch, batch_ring_schedule(model_config, mesh, batch))

    return apply


@functools.lru_cache(maxsize=8)  # one program per (config, mesh, plan) in a process; each entry holds its executables
def make_eval_step(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None,
                   loss_chunk: int = 0):
    """``evaluate(model, batch) -> (loss_sum, weight, correct)`` summed over the mesh (jitted; built once
    per process for equal arguments).

    Args:
        model_config: the model's config (checked against ``mesh``).
        mesh: the ``(data, context)`` mesh.
        plan: parameter layout (``sharding_plan``; the one the model was trained in). Sharded:
            each device takes its parameter shards and gathers the weights as the train step
            does (one layer at a time inside the scanned layer step), so no device ever holds a
            replicated copy of the model. ``None`` or unsharded: replicated parameters.
        loss_chunk: tokens per chunk of the cross-entropy (0: unchunked).
    """
    axes = mesh_axes(mesh)

    def body(model, batch, gather_layer, schedule):
        sums = _local_sums(model, batch, None, loss_chunk=loss_chunk, gather_layer=gather_layer, schedule=schedule)
        return tuple(jax.lax.psum(x, axes) for x in sums)

    return _sharded_apply(model_config, mesh, plan, body, P())


@functools.lru_cache(maxsize=8)  # as make_eval_step
def make_logits_fn(model_config: TransformerConfig, mesh, *, plan: partitioning.ShardingPlan | None = None):
    """``logits(model, batch) -> [batch, seq, vocab]`` in the layout order of ``batch`` (jitted; built once
    per process for equal arguments), at its (padded) length: ``train.unlayout(logits, model_config, S)``
    gives the caller's ``S`` positions in original order. ``plan``: the parameters' layout, as for
    ``make_eval_step`` (sharded: never replicated)."""

    def body(model, batch, gather_layer, schedule):
        hidden = lambda t, q, s: model.hidden(t, q, s, gather_layer=gather_layer, schedule=schedule)
        return model.logits(jax.vmap(hidden)(batch.tokens, batch.positions, batch.segment_ids))

    return _sharded_apply(model_config, mesh, plan, body, P(*batch_spec(model_config), None))


def evaluate(model, stream: BatchSource, num_batches: int, mesh, model_config: TransformerConfig, eval_step=None,
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
