"""What the experiment scripts share around ``ringsplash.train.fit`` (where they run is
``ringsplash.distributed.choose_platform``): one-line errors for bad flags, the dtype and kernel flags, and
continuing a run's checkpoints to more steps. Scripts only: the library never imports it."""

import dataclasses
import json
import os

# one-line errors for bad flags and paths: shared with scripts/ (ringsplash.cli), re-exported for the experiments
from ringsplash.cli import (  # noqa: F401
    OUTPUT_DIRS,
    PATH_ERRORS,
    check_flags,
    check_optional_flags,
    check_output_dirs,
    flag_error,
    run_script,
)

#: the model's parameter / compute dtypes (ringsplash.model.config.DTYPES)
DTYPES = ("float32", "bfloat16", "float16")
#: ``--compute-dtype``: a dtype, or ``auto`` (the default): :func:`compute_dtype` chooses
COMPUTE_DTYPES = (*DTYPES, "auto")


def compute_dtype(config) -> str:
    """The compute dtype of ``--compute-dtype``, the one rule of every experiment: as given, or for
    ``auto`` bfloat16 (with float32 parameters: the usual choice) where the run computes on a TPU or
    compiles for one (``--preflight``), float32 elsewhere (the CPU, where bfloat16 matmuls are slow
    and the tests compare at float32 tolerances). Call it once the platform is chosen
    (:func:`choose_devices`): it starts JAX."""
    if config.compute_dtype != "auto":
        return config.compute_dtype
    import jax

    return "bfloat16" if getattr(config, "preflight", "") or jax.default_backend() == "tpu" else "float32"


# ------------------------------------------------------------------------------------ platform


def choose_devices(config, *, cpu_context: int, other: int = 1, shards_context: bool = True):
    """Choose where the run computes (``distributed.choose_platform``: the TPU when there is one, else
    the CPU) and return ``config`` with ``--context-parallel 0`` (auto) resolved: ``cpu_context``
    simulated devices on the CPU; on an accelerator, every device the run sees over the ``other``
    mesh positions (``--data-parallel`` x ``--ulysses-parallel``); 1 when the attention shards over
    none (``shards_context`` False). A number given is kept. Call it before anything starts JAX."""
    from ringsplash import distributed

    given = config.context_parallel
    context = (given or cpu_context) if shards_context else 1
    platform = distributed.choose_platform(other * context)
    if given:
        return config
    if shards_context and platform.split(",")[0] != "cpu":
        import jax

        context = jax.device_count() // other
        if context < 1:
            raise flag_error("context_parallel", given, f"a device count: {jax.device_count()} devices cannot hold "
                             f"the {other} positions of the other mesh axes")
    return dataclasses.replace(config, context_parallel=context)


def context_devices(config) -> int:
    """``config.context_parallel`` once ``choose_devices`` has resolved it; 0 (auto) is refused."""
    if not config.context_parallel:
        raise ValueError("--context-parallel 0 (auto) is resolved by main() (_runtime.choose_devices) before the "
                         "model config is built: pass a device count")
    return config.context_parallel


# ------------------------------------------------------------------------------------ flags

def check_block(config) -> None:
    """``block``: 0 (auto: the tuned blocks of the platform) or a multiple of 128 tokens."""
    if isinstance(config.block, bool) or not isinstance(config.block, int) or config.block < 0 or config.block % 128:
        raise flag_error("block", config.block, "0 (auto: the blocks tuned for the platform) or a multiple of 128")


def check_loader_seed(config) -> None:
    """``seed``: an integer the data loader takes (``LoaderConfig.seed``, below ``data.loader.SEED_LIMIT``):
    refused when parsed, naming the flag; a larger one failed only once the corpora were read, naming no flag."""
    from ringsplash.data.loader import SEED_LIMIT

    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed < SEED_LIMIT:
        raise flag_error("seed", config.seed, f"an integer in [0, {SEED_LIMIT - 1}] (the data loader's seeds)")


def splash_config(config):
    """The ``SplashConfig`` of ``--backend`` and ``--block`` (0: every block left to the tuned table)."""
    from ringsplash.splash import SplashConfig

    b = config.block or None
    return SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend)


# ------------------------------------------------------------------------------------ runs


def continue_to(run_dir: str, tc, say=print) -> int | None:
    """Prepare ``run_dir`` (one ``train.fit`` run) to resume with ``tc``; the step of its newest
    checkpoint (None: a fresh run).

    A resumed run may ask for more steps than it was started with (a larger ``--steps``): it then
    continues from its checkpoint to the new total, its learning-rate schedule (warmup, cosine
    decay) planned over the new total from there on. The run's ``config.json`` is updated to the
    new ``steps`` / ``warmup_steps`` (the fields that follow from it), so that ``fit``'s check of
    the run's config passes; every other field must still match. Fewer steps than the checkpoint
    holds is an error: a run never goes back."""
    from ringsplash import checkpoints
    from ringsplash.distributed import is_main_process

    latest = checkpoints.latest_step(os.path.join(run_dir, "checkpoints"))
    path = os.path.join(run_dir, "config.json")
    if latest is None or not os.path.exists(path):
        return latest
    if tc.steps < latest:
        raise flag_error("steps", tc.steps, f">= {latest}: {run_dir} holds a checkpoint at step {latest} "
                                            f"(a run continues, never goes back; a new --run-dir starts afresh)")
    with open(path) as f:
        stored = json.load(f)
    train = stored.get("train", {})
    if train.get("steps") != tc.steps:
        say(f"{run_dir}: continuing from step {latest} to {tc.steps} steps (started for {train.get('steps')}); "
            f"the learning-rate schedule now spans {tc.steps} steps")
        train.update(steps=tc.steps, warmup_steps=tc.warmup_steps)
        if is_main_process():
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(stored, f, indent=1)
            os.replace(tmp, path)
    import jax

    if jax.process_count() > 1:  # nobody reads config.json while process 0 rewrites it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("continued run config")
    return latest
