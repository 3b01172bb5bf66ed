"""``load_hf``: a Hugging Face checkpoint directory → ``Transformer``, optionally straight into
FSDP shardings (each process reading only the slices its devices hold)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ringsplash import partitioning
from ringsplash._internal.scalar_checks import as_scalar, check_bool
from ringsplash.hf.config import config_from_hf, read_config_json
from ringsplash.hf.families import family_of
from ringsplash.hf.io import Checkpoint
from ringsplash.hf.names import TensorName, named_leaves
from ringsplash.model import ContextParallel, Transformer, abstract_model
from ringsplash.model.config import DTYPES

#: tensors a checkpoint may hold that no parameter reads (old checkpoints saved RoPE buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")


def dtype_name(arg: str, value) -> str:
    """A config dtype name (``"float32"`` / ``"bfloat16"`` / ``"float16"``) from a name or a numpy /
    jnp dtype."""
    if isinstance(value, str) and value in DTYPES:
        return value
    try:
        name = np.dtype(value).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"{arg} must be one of {DTYPES} (a name or a numpy dtype), got {arg}={value!r}")
    return name


def hf_shape(tn: TensorName, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one HF tensor of a parameter of ``shape`` (one layer's, transposed or not)."""
    one = shape[1:] if tn.stacked else shape
    return tuple(reversed(one)) if tn.transpose else tuple(one)


def check_tensors(ckpt: Checkpoint, names: dict[str, TensorName], abstract: dict, config) -> None:
    """Every tensor the model needs is there with the right shape and a float dtype; no tensor is
    left over (a tensor nothing reads would mean a different model)."""
    expected = {}
    for path, tn in names.items():
        shape = tuple(abstract[path].shape)
        for layer in range(shape[0]) if tn.stacked else (None,):
            expected[tn.hf_name(layer)] = (path, hf_shape(tn, shape))
    have = ckpt.names()
    missing = sorted(set(expected) - have)
    if missing:
        path, shape = expected[missing[0]]
        raise ValueError(f"{ckpt.path!r} lacks tensor {missing[0]!r} (expected shape {shape}, for parameter {path})"
                         + (f" and {len(missing) - 1} more: {missing[1:6]}" if len(missing) > 1 else ""))
    for name, (path, shape) in expected.items():
        found = ckpt.shape(name)
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found}, expected {shape} (parameter {path} of the config "
                             f"in config.json): the weights do not match config.json")
        tag = ckpt.dtype(name)
        if tag not in _FLOAT_TAGS:
            raise ValueError(f"tensor {name!r} has dtype {tag}, expected a float dtype {_FLOAT_TAGS}")
    extra = sorted(n for n in have - set(expected) if not n.endswith(_IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and config.features.tie_embeddings))
    if extra:
        raise ValueError(f"{ckpt.path!r} has tensors this config does not use: {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''} (config.json describes a different model than the "
                         f"weights, or a feature not supported)")


def _normalise(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _reader(ckpt: Checkpoint, tn: TensorName, shape: tuple[int, ...], dtype):
    """``read(index) -> numpy array`` of ``param[index]`` (index: slices over the parameter's global
    shape), reading only those bytes; each distinct index is read once."""
    cache: dict[tuple, np.ndarray] = {}

    def one(name: str, index: tuple[slice, ...]) -> np.ndarray:
        if tn.transpose:
            return ckpt.read(name, tuple(reversed(index))).T
        return ckpt.read(name, index)

    def read(index) -> np.ndarray:
        idx = _normalise(index, shape)
        key = tuple((s.start, s.stop, s.step) for s in idx)
        if key not in cache:
            if tn.stacked:
                x = np.stack([one(tn.hf_name(i), idx[1:]) for i in range(*idx[0].indices(shape[0]))])
            else:
                x = one(tn.hf_name(), idx)
            cache[key] = np.asarray(x, dtype)
        return cache[key]

    return read


def load_hf(path, *, mesh: jax.sharding.Mesh | None = None, param_dtype="float32", compute_dtype=None,
            attention: str | None = None, fsdp: bool = True, **overrides) -> Transformer:
    """The ``Transformer`` of a Hugging Face checkpoint directory.

    Args:
        path: a directory as ``save_pretrained`` writes it: config.json and ``model.safetensors``
            or sharded files with ``model.safetensors.index.json`` (pickled ``.bin`` files are refused).
        mesh: place every parameter straight into its sharding on this mesh (FSDP over every mesh
            axis, as the trainer lays parameters out; ``fsdp=False``: replicated): each process
            reads only the slices its devices hold; no host holds the whole model. None: arrays on
            the default device.
        param_dtype, compute_dtype: names or numpy dtypes (``compute_dtype=None``: ``param_dtype``).
        attention: a single-device strategy, short for ``context_parallel=ContextParallel(attention)``
            (None: the default ``"splash"``, or the ``context_parallel`` override, e.g.
            ``ContextParallel("ring", ring_size=4)``); any other ``TransformerConfig`` field (``splash``,
            ``max_seq_len``, ...) goes in ``overrides``.

    The returned model's ``config`` says everything needed to run it (``config_from_hf``).
    """
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):  # was an AttributeError in the sharding plan
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__} {mesh!r}")
    fsdp = check_bool("fsdp", as_scalar(fsdp))  # fsdp="no" was truthy: FSDP, silently
    path = os.fspath(path)
    d = read_config_json(path)
    family = family_of(d)
    param_dtype = dtype_name("param_dtype", param_dtype)
    compute_dtype = param_dtype if compute_dtype is None else dtype_name("compute_dtype", compute_dtype)
    if attention is not None:
        if "context_parallel" in overrides:
            raise ValueError(f"pass attention={attention!r} or context_parallel={overrides['context_parallel']!r}, "
                             f"not both")
        overrides["context_parallel"] = ContextParallel(attention)
    config = config_from_hf(d, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    names = family.name_map(config)
    like = abstract_model(config)
    abstract = named_leaves(like, jax.ShapeDtypeStruct)
    specs = {}  # {path: PartitionSpec}: the trainer's layout (train.sharding_plan), the same plan on the same tree
    if mesh is not None:
        plan = partitioning.plan_model_sharding(like, mesh, fsdp=fsdp)
        specs = named_leaves(plan.specs, PartitionSpec)
    loaded = {}
    with Checkpoint(path) as ckpt:
        check_tensors(ckpt, names, abstract, config)
        for p, struct in abstract.items():
            shape, dtype = tuple(struct.shape), np.dtype(struct.dtype)
            read = _reader(ckpt, names[p], shape, dtype)
            if mesh is None:
                loaded[p] = jnp.asarray(read(()))
            else:
                loaded[p] = jax.make_array_from_callback(shape, NamedSharding(mesh, specs[p]), read)
    structs, treedef = jax.tree_util.tree_flatten(like)
    if len(structs) != len(loaded):
        raise AssertionError("parameter tree and loaded tensors disagree")  # unreachable: every leaf is a struct
    return jax.tree_util.tree_unflatten(treedef, [loaded[p] for p in abstract])


__all__ = ["check_tensors", "dtype_name", "hf_shape", "load_hf"]
