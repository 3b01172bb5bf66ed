"""``TrainState`` (model, optimiser state, step, data seed): built, placed on the mesh by a
``ShardingPlan``, saved and restored as sharded orbax checkpoints (``ringsplash.checkpoints``)
straight into the plan's shardings, hashed (``state_digest``), and the run's config checked."""

import functools
import json
import os
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ringsplash import checkpoints, partitioning
from ringsplash.distributed import is_main_process
from ringsplash.model import Transformer, TransformerConfig, abstract_model
from ringsplash.model._legacy import nest_dict
from ringsplash.train.batches import _global_array
from ringsplash.train.config import OLD_TRAIN_FIELDS, TrainConfig, make_optimizer


class TrainState(NamedTuple):
    model: Transformer
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: steps done = index of the next batch of the data stream
    data_seed: jax.Array  # int32 scalar: the data stream's seed


def _fresh(model_config: TransformerConfig, tc: TrainConfig, key: jax.Array):
    """(parameters, AdamW state) of a fresh model initialised from ``key``. The key is an argument
    of the jitted program, not a constant: XLA would otherwise constant-fold the whole random
    initialisation on the host at compile time (minutes for a 1B model)."""
    params = eqx.filter(Transformer(model_config, key=key), eqx.is_array)
    return params, make_optimizer(tc).init(params)


def _start(model_config: TransformerConfig, tc: TrainConfig, params, opt_state, data_seed: int) -> TrainState:
    """The step-0 ``TrainState`` of ``model_config``'s parameters and an optimiser state."""
    _, static = eqx.partition(abstract_model(model_config),
                              _is_struct)
    return TrainState(eqx.combine(params, static), opt_state, jnp.asarray(0, jnp.int32),
                      jnp.asarray(data_seed, jnp.int32))


def _state_shardings(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                     plan: partitioning.ShardingPlan):
    """(parameter shardings, optimiser-state shardings) of ``plan`` on ``mesh``, as ``abstract_state``'s."""
    params = eqx.filter(abstract_model(model_config), _is_struct)
    param_sh = partitioning.shardings(plan.specs, mesh)
    return param_sh, partitioning.optimizer_shardings(make_optimizer(tc), params, param_sh, mesh)


def init_state(model_config: TransformerConfig, tc: TrainConfig, data_seed: int = 0) -> TrainState:
    """A fresh state on the default device: the model initialised from ``tc.seed``, AdamW state, step 0.
    The same function as ``init_sharded_state``, jitted without its output shardings, so both draw the same bits."""
    params, opt_state = _init_fn(model_config, _init_config(tc))(jax.random.key(tc.seed))
    return _start(model_config, tc, params, opt_state, data_seed)


def sharded_init_fn(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                    plan: partitioning.ShardingPlan):
    """The jitted program ``init_sharded_state`` runs, ``fn(jax.random.key(tc.seed))``: it returns
    (parameters, AdamW state) with the shardings of ``abstract_state``. Lower it for a TPU topology to see the
    per-device memory of a fresh initialisation (``ringsplash.aot.compile_report``). Built once per
    process for equal model configs, meshes and plans."""
    return _init_fn(model_config, _init_config(tc), mesh, plan)


def _init_config(tc: TrainConfig) -> TrainConfig:
    """``tc`` reduced to what a fresh state may depend on: AdamW's initial state (zero moments, step
    counts) is the same tree and values for any schedule and hyper-parameters (tested); ``grad_clip``
    stays, as it chooses a link of the optimiser chain."""
    return TrainConfig(grad_clip=tc.grad_clip)


@functools.lru_cache(maxsize=4)  # small: each entry holds its executables
def _init_fn(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh | None = None,
             plan: partitioning.ShardingPlan | None = None):
    fresh = functools.partial(_fresh, model_config, tc)
    if mesh is None:
        return jax.jit(fresh)
    return jax.jit(fresh, out_shardings=_state_shardings(model_config, tc, mesh, plan))


def init_sharded_state(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                       plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """A fresh state created in place on ``mesh``: one jitted initialisation whose outputs carry the
    shardings of ``abstract_state`` (parameters and AdamW moments laid out by ``plan``), so each device
    computes only its own shards and no host ever holds the whole model or its optimiser state. The
    values are ``init_state``'s bit for bit (JAX's partitionable threefry draws the same numbers under
    any sharding). Collective: every process calls it."""
    params, opt_state = sharded_init_fn(model_config, tc, mesh, plan)(jax.random.key(tc.seed))
    return _start(model_config, tc, params, opt_state, data_seed)


def start_from(model: Transformer, model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
               plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """A fresh state from given parameters (e.g. a pretrained model) under ``model_config``: the
    parameters moved into the plan's shardings (in one process from whichever devices hold them, e.g.
    a model trained on one device; across processes by a jitted program, no host copy: ``model``'s
    arrays must live on ``mesh``) and a fresh AdamW state created there."""
    if not isinstance(model, Transformer):
        raise TypeError(f"init_model must be a ringsplash Transformer, got {type(model).__name__}")
    try:
        model = model.with_config(model_config)
    except ValueError:
        raise ValueError("init_model's parameters do not have the shapes and dtypes model_config describes "
                         f"(init_model: {model.config.num_layers} layers, d_model {model.config.d_model}, "
                         f"param_dtype {model.config.param_dtype}; model_config: {model_config.num_layers} layers, "
                         f"d_model {model_config.d_model}, param_dtype {model_config.param_dtype})") from None
    param_sh, opt_sh = _state_shardings(model_config, tc, mesh, plan)
    params = eqx.filter(model, eqx.is_array)
    if all(x.is_fully_addressable for x in jax.tree.leaves(params)):  # one process: from any devices
        params = jax.device_put(params, param_sh)
    else:  # arrays spanning processes: resharded on their mesh by a jitted program
        params = jax.jit(lambda p: p, out_shardings=param_sh)(params)
    opt_state = jax.jit(make_optimizer(tc).init, out_shardings=opt_sh)(params)
    return _start(model_config, tc, params, opt_state, data_seed)


def place_state(model: Transformer, opt_state, mesh: jax.sharding.Mesh, plan: partitioning.ShardingPlan,
                optimizer: optax.GradientTransformation):
    """(model, opt_state) on the mesh laid out by ``plan`` (multi-host safe, from host copies)."""
    params, static = eqx.partition(model, eqx.is_array)
    param_sh = partitioning.shardings(plan.specs, mesh)
    opt_sh = partitioning.optimizer_shardings(optimizer, params, param_sh, mesh)
    place = lambda tree, sh: jax.tree.map(lambda x, s: _global_array(x, s), tree, sh)
    return eqx.combine(place(params, param_sh), static), place(opt_state, opt_sh)


def _is_struct(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def abstract_state(model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                   plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """The ``TrainState`` that ``fit`` trains, with no array allocated: parameters and optimiser
    state as ``jax.ShapeDtypeStruct``s carrying their shardings on ``mesh`` (parameters and AdamW
    moments laid out by ``plan``, other optimiser leaves replicated), step and data seed as numpy
    scalars (every process holds them). The target of a sharded restore (``restore_sharded_state``)."""
    optimizer = make_optimizer(tc)
    model = abstract_model(model_config)
    params, static = eqx.partition(model, _is_struct)
    param_sh, opt_sh = _state_shardings(model_config, tc, mesh, plan)
    with_sharding = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    params = jax.tree.map(with_sharding, params, param_sh)
    opt_state = jax.tree.map(with_sharding, jax.eval_shape(optimizer.init, params), opt_sh)
    return TrainState(eqx.combine(params, static), opt_state, np.asarray(0, np.int32),
                      np.asarray(data_seed, np.int32))


def resume_state(path: str, model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                 plan: partitioning.ShardingPlan, data_seed: int = 0) -> tuple[TrainState, list[tuple[int, str]]]:
    """``(state, skipped)``: the newest checkpoint under ``path`` that reads back intact
    (``checkpoints.restore_newest_valid``: its arrays match their recorded checksums), restored
    straight into the shardings of ``abstract_state`` (the saving mesh and process count may
    differ; each device reads its own shards, no host holds the whole state), and the newer
    checkpoints it skipped, ``[(step, reason)]`` (each also warned about). Collective.

    Raises:
        checkpoints.CheckpointCorruptError: when no checkpoint verifies, naming what is wrong
            with each.
    """
    state, _, skipped = checkpoints.restore_newest_valid(path, abstract_state(model_config, tc, mesh, plan, data_seed))
    state = state._replace(step=jnp.asarray(state.step, jnp.int32), data_seed=jnp.asarray(state.data_seed, jnp.int32))
    return state, skipped


def restore_sharded_state(path: str, model_config: TransformerConfig, tc: TrainConfig, mesh: jax.sharding.Mesh,
                          plan: partitioning.ShardingPlan, data_seed: int = 0) -> TrainState:
    """The newest checkpoint under ``path`` that verifies, restored into the shardings of
    ``abstract_state`` (``resume_state`` without the list of skipped checkpoints). Collective."""
    return resume_state(path, model_config, tc, mesh, plan, data_seed)[0]


def save_checkpoint(path: str, state: TrainState, *, config: dict | None = None, keep: int | None = 3,
                    data_iterator=None) -> None:
    """Save ``state`` as checkpoint ``state.step`` under the directory ``path`` (sharded, atomic,
    orbax; see ``ringsplash.checkpoints``), with ``data_iterator``'s state (each process its own,
    positioned at batch ``state.step``) if given. Collective: every process calls it. A step already
    saved is not written again (batches are a pure function of (seed, step), so it is the same
    state); only the newest ``keep`` checkpoints are kept."""
    if int(state.step) in checkpoints.all_steps(path):
        return
    checkpoints.save_state(path, state, config=config, keep=keep, data_iterator=data_iterator)


def load_checkpoint(path: str, like: TrainState) -> TrainState:
    """Restore the latest checkpoint under ``path`` into the structure, static fields and
    shardings of ``like`` (arrays or ``jax.ShapeDtypeStruct``s; the mesh may differ from the
    saving one). Collective."""
    return checkpoints.restore_state(path, like)


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
            stored = upgrade_run_config(json.load(f))
        diff = sorted(_config_diff(stored, current, ignore))
        if diff:
            raise ValueError(
                f"{path} was written by a run with a different config; resuming it needs the same one. "
                "Differing fields (stored vs given): " + "; ".join(f"{k}: {a!r} vs {b!r}" for k, a, b in diff)
            )
    if is_main_process():
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(current, f, indent=1)
        os.replace(tmp, path)


def upgrade_run_config(stored: dict) -> dict:
    """A run's config.json written by the previous release in today's form: the model config's flat
    context-parallel and family fields nested, the trainer's context-parallel degrees dropped (the
    mesh comes from the model config)."""
    stored = dict(stored)
    if isinstance(stored.get("model"), dict):
        stored["model"] = nest_dict(stored["model"])
    if isinstance(stored.get("train"), dict):
        stored["train"] = {k: v for k, v in stored["train"].items() if k not in OLD_TRAIN_FIELDS}
    return stored


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
