"""Test-run set-up: CPU platform with 8 simulated devices, set before JAX initialises.

TPU code is proven here without a TPU: Pallas interpret mode for numerics, libtpu compiles for
real TPU topologies (``jax.experimental.topologies``) and simulated CPU meshes.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
#: ``JAX_PLATFORMS=tpu pytest -m tpu`` on a TPU machine runs the on-chip tier (``tpu`` marker);
#: everywhere else those tests skip, saying why
ON_CHIP = "tpu" in os.environ["JAX_PLATFORMS"].split(",")
# libtpu looks for TPU metadata on import; on a CPU machine tell it there is none to find. The names set
# here (not inherited) are removed again for a child that runs on the chip (test_docs_examples.py).
_NO_TPU_METADATA = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}
FAKED_TPU_ENV = () if ON_CHIP else tuple(name for name in _NO_TPU_METADATA if name not in os.environ)
for _name in FAKED_TPU_ENV:
    os.environ[_name] = _NO_TPU_METADATA[_name]
# test subprocesses (scripts) load libtpu too; let them share it
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The suite compiles hundreds of CPU programs that run once on tiny shapes: XLA:CPU's backend
# optimisations (LLVM -O0, no expensive passes) cost more than they save there (~30% of a
# training-step test). Numerics are what the tests check, and the tolerances hold unchanged;
# TPU compiles ignore the setting (the same memory report and HLO either way, measured for a
# v5e:2x2 compile). Inherited by the scripts and processes the tests start; export
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 to run the suite with full optimisation.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# No persistent compilation cache, even if the environment asks for one. XLA:CPU (jax 0.10.2) can
# run a program's independent collectives in different orders on different devices (every
# shard_map collective carries channel id 1), and the program then hangs in XLA's rendezvous or
# pairs the wrong buffers. Read back from the cache, the model's 4-device logits + gradient program
# (two independent rings, test_model_masks) hung in 12 of 14 loads; compiled afresh in a fresh
# process it had run right every time, though in the suite it also failed fresh (its test now runs
# the two rings as two programs). Inherited by the scripts and processes the tests start.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# torch (the transformers oracle) on one intra-op thread. In a worker that had run other tests first, torch's
# second OpenMP thread computed its share of a forward off by up to 1.1e-3 (2026-12-07: a tiny Llama's logits
# rows 256-511, the rows of its matmuls that thread takes; in CI, Mistral's attention heads 2-3, every position
# but the first), where a fresh process and its first thread agree with ours to 5e-6; not found why (the
# threads' MXCSR modes were the default). The oracle's models are tiny, and -n 2 keeps both cores busy anyway.
# Inherited by the scripts and processes the tests start.
os.environ["OMP_NUM_THREADS"] = "1"

import jax  # noqa: E402 (after the environment above)
from jax._src import compiler as _jax_compiler  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
# Run single-device CPU computations inline, not queued on a dispatch thread. The Pallas TPU
# interpreter executes kernel bodies in io_callbacks that dispatch eager JAX ops themselves; with
# asynchronous dispatch those ops could queue behind work the callback is waiting for (eager ops
# the test dispatched after the interpreted kernel), and the suite deadlocked. Inline dispatch
# leaves nothing queued, so no test has to wait on an interpreted kernel by hand.
jax.config.update("jax_cpu_enable_async_dispatch", False)
# Single-device CPU programs compile with XLA:CPU's classic elemental emitters instead of its MLIR
# fusion emitters (jax 0.10.2's default), which take twice as long to compile the suite's programs
# (measured: the extension experiment's single-device programs 2x; the whole suite 1,866 s -> 1,507 s
# of CPU). Same float32 operations; the tolerances hold unchanged. Not for multi-device programs:
# XLA:CPU can run a program's independent collectives in different orders on different devices,
# and every shard_map collective carries channel id 1, so two of them can pair the wrong buffers;
# with the classic emitters the FSDP training step returned NaN in 1 of 4 runs (default emitters: 8
# of 8 right) and failed across two processes (gloo: "Received data size doesn't match"). Scripts
# and processes the tests start compile as a user's would. docs/training.md: "Compiling on CPU".
_jax_get_compile_options = _jax_compiler.get_compile_options


def _single_device_cpu_compile_options(num_replicas, num_partitions, *args, **kwargs):
    backend = kwargs.get("backend")
    if num_replicas * num_partitions == 1 and backend is not None and backend.platform == "cpu":
        overrides = kwargs.get("env_options_overrides") or {}
        kwargs["env_options_overrides"] = {"xla_cpu_use_fusion_emitters": False, **overrides}
    return _jax_get_compile_options(num_replicas, num_partitions, *args, **kwargs)


_jax_compiler.get_compile_options = _single_device_cpu_compile_options
# JAX starts now, with its 8 devices: a script's main() run in a test process (the main job, the
# extension experiment), which sets the device count to its own mesh's when JAX has not started,
# cannot leave the tests after it short of devices.
jax.devices()

from hypothesis import HealthCheck, settings  # noqa: E402

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ringsplash", deadline=None, max_examples=25, suppress_health_check=_SUPPRESS)
# the fast tier (-m "not slow" / -m fast): few examples per property; the other tiers keep 25
settings.register_profile("fast", deadline=None, max_examples=5, suppress_health_check=_SUPPRESS)
settings.load_profile("ringsplash")

import pytest  # noqa: E402

#: markers whose tests are expensive by kind: they are also ``slow`` unless marked ``cheap``
EXPENSIVE_KINDS = ("tpu_compile", "multiprocess", "e2e")
#: a fast-tier test over this many seconds (setup + call) is listed in the terminal summary
FAST_BUDGET_S = float(os.environ.get("RINGSPLASH_FAST_BUDGET_S", "5"))
#: RINGSPLASH_FAST_BUDGET_STRICT=1: a fast-tier test over 3x the budget fails the run (off by
#: default: this machine is shared and its timings are noisy)
FAST_BUDGET_STRICT = os.environ.get("RINGSPLASH_FAST_BUDGET_STRICT") == "1"
_fast_durations: dict[str, float] = {}  # nodeid -> setup + call seconds


def _fast_tier_selected(config) -> bool:
    expr = " ".join((config.getoption("markexpr", "") or "").split())
    return "not slow" in expr or expr == "fast"


def pytest_configure(config):
    if os.environ.get("HYPOTHESIS_PROFILE"):
        settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
    elif _fast_tier_selected(config):
        settings.load_profile("fast")


def pytest_report_header(config):
    return f"ringsplash: hypothesis profile {settings.get_current_profile_name()!r}, fast-tier budget {FAST_BUDGET_S:g} s"


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the markers added here take part in it
def pytest_collection_modifyitems(config, items):
    """Tier every test: an expensive kind (``tpu_compile``, ``multiprocess``, ``e2e``) is also
    ``slow`` unless it is marked ``cheap``; whatever is not ``slow`` is ``fast``, so a new
    unmarked test lands in the fast tier and the duration guard watches it."""
    # modules ranked by their most expensive test: end-to-end / multi-process / TPU-compile first, then
    # other slow tests, then the rest
    rank: dict[str, int] = {}
    chip = jax.devices()[0].platform == "tpu"
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if "tpu" in names and not chip:
            item.add_marker(pytest.mark.skip(reason="needs a TPU chip (CI has none): on one, run "
                                                     "JAX_PLATFORMS=tpu python -m pytest -m tpu"))
        if "slow" not in names and "cheap" not in names and names.intersection(EXPENSIVE_KINDS):
            item.add_marker(pytest.mark.slow)
            names.add("slow")
        if "slow" not in names:
            item.add_marker(pytest.mark.fast)
        if _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        r = 0 if names.intersection(EXPENSIVE_KINDS) else 1 if "slow" in names else 2
        rank[item.module.__name__] = min(rank.get(item.module.__name__, 2), r)
    # heaviest modules first, each contiguous and in its own order (a module fixture's tests: one xdist group): xdist's
    # workers then end on short tests instead of one running a minute-long test alone at the end; a
    # stable sort, so every worker collects the same order
    items.sort(key=lambda item: rank[item.module.__name__])


def _uses_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a module- (or package-) scoped fixture of its own module. Under ``--dist
    loadgroup`` (pyproject.toml) such tests share an ``xdist_group``, so the fixture is set up on one
    worker only (with ``worksteal`` the multi-process training fixtures ran on both: ~35 s each)."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.nodeid.split("::")[0]
    return info is not None and any(
        d.scope in ("module", "package") and d.baseid == module
        for defs in info.name2fixturedefs.values() for d in defs)


def pytest_runtest_logreport(report):
    """Duration guard: add up setup + call time of every fast-tier test (runs on the xdist
    controller too, where the workers' reports arrive)."""
    if report.when not in ("setup", "call") or "fast" not in report.keywords:
        return
    _fast_durations[report.nodeid] = _fast_durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if FAST_BUDGET_STRICT and exitstatus == 0 and any(t > 3 * FAST_BUDGET_S for t in _fast_durations.values()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = sorted(((t, n) for n, t in _fast_durations.items() if t > FAST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.section(f"fast-tier tests over {FAST_BUDGET_S:g} s (RINGSPLASH_FAST_BUDGET_S): "
                                 "make them cheaper or mark them slow")
        for t, nodeid in over:
            terminalreporter.write_line(f"{t:8.1f} s  {nodeid}")


@pytest.fixture(autouse=True)
def _xla_optimized(request):
    """``@pytest.mark.xla_optimized``: compile with XLA's full optimisations (the suite runs at
    -O0, see the top of this file), for tests that compare rounding error between two compiled
    programs, which depends on the codegen users get."""
    if request.node.get_closest_marker("xla_optimized") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations",
                          os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("y", "yes", "t", "true", "on", "1"))


@pytest.fixture
def key(request):
    """A fresh PRNG key per test, derived from the test's name (reproducible, never zeros)."""
    import zlib

    nodeid = request.node.nodeid
    if request.node.get_closest_marker("xdist_group"):  # xdist's loadgroup appends "@<group>" on its workers
        nodeid = nodeid.rsplit("@", 1)[0]
    return jax.random.key(zlib.crc32(nodeid.encode()))
