"""What the experiment scripts share around ``ringsplash.train.fit`` (where they run is
``ringsplash.distributed.choose_platform``): one-line errors for bad flags, the dtype and kernel flags, and
continuing a run's checkpoints to more steps. Scripts only: the library never imports it."""

import contextlib
import dataclasses
import json
import os
import sys

#: the model's parameter / compute dtypes (ringsplash.model.config.DTYPES)
DTYPES = ("float32", "bfloat16", "float16")


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_error(name: str, value, accepted: str) -> ValueError:
    """The error of a bad flag: it names the flag, the value given and what is accepted."""
    return ValueError(f"{_flag(name)} {value!r} is not accepted: expected {accepted}")


def check_flags(config, *, choices: dict | None = None, positive: tuple = (), non_negative: tuple = ()) -> None:
    """Raise ``flag_error`` for the first field of ``config`` outside its ``choices`` / not an int
    ``>= 1`` (``positive``) / ``>= 0`` (``non_negative``)."""
    for name, allowed in (choices or {}).items():
        value = getattr(config, name)
        if isinstance(value, bool) or value not in tuple(allowed):
            raise flag_error(name, value, f"one of {', '.join(map(str, allowed))}")
    for names, minimum in ((positive, 1), (non_negative, 0)):
        for name in names:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise flag_error(name, value, f"an integer >= {minimum}")


def check_block(config) -> None:
    """``block``: 0 (auto: the tuned blocks of the platform) or a multiple of 128 tokens."""
    if isinstance(config.block, bool) or not isinstance(config.block, int) or config.block < 0 or config.block % 128:
        raise flag_error("block", config.block, "0 (auto: the blocks tuned for the platform) or a multiple of 128")


def splash_config(config):
    """The ``SplashConfig`` of ``--backend`` and ``--block`` (0: every block left to the tuned table)."""
    from ringsplash.splash import SplashConfig

    b = config.block or None
    return SplashConfig(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, backend=config.backend)


@contextlib.contextmanager
def _one_line_argparse_errors():
    """argparse's errors (unknown flag, a value of the wrong type, an unknown preset) as one line,
    without the usage block above it."""
    import argparse

    def error(parser, message):
        parser.exit(2, f"{parser.prog}: error: {message} (--help lists every flag)\n")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run_script(main, parse_args, argv=None):
    """``main(parse_args(argv))`` from the command line: a bad flag or run directory is one line on
    stderr (``<script>: error: ...``, exit status 2), never a traceback; so is an optional package
    the run needs and does not find (exit status 1, the line names the extra to install)."""
    prog = os.path.basename(sys.argv[0])
    with _one_line_argparse_errors():
        try:
            config = parse_args(argv)
        except (ValueError, TypeError) as e:  # the config's own checks (each names its flag)
            sys.exit(_one_line(prog, e))
    from ringsplash._optional import MissingDependency

    try:
        return main(config)
    except (ValueError, FileNotFoundError) as e:  # bad input found while setting up (a config check, a path)
        sys.exit(_one_line(prog, e))
    except MissingDependency as e:  # an optional package the run needs: one line naming what to install
        _one_line(prog, e)
        sys.exit(1)


def _one_line(prog: str, error: BaseException) -> str:
    print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    return 2


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
