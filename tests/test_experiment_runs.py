"""The experiment scripts as a user runs them: killed (SIGKILL) mid-run and resumed, they end where an
uninterrupted run ends, and a larger step count continues them; a bad flag is one line on stderr
naming the flag, the value and what is accepted; they choose the TPU when there is one and the CPU
otherwise (no JAX_PLATFORMS to set, no libtpu noise on a CPU machine), say which at start, and
take the dtype / backend / block flags into the model's config.

(The main job's kill-and-resume test is tests/test_scripts.py's.)"""

import contextlib
import glob
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys

import pytest

from support.processes import child_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXPERIMENTS = os.path.join(ROOT, "experiments")


def _job(name):
    spec = importlib.util.spec_from_file_location(f"_experiment_{name}", os.path.join(EXPERIMENTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _user_env(**extra):
    """A user's environment on a CPU machine: no JAX_PLATFORMS, none of the test run's TPU settings."""
    env = child_env()
    for name in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"):
        env.pop(name, None)
    return {**env, **extra}


def _killed(script, args, step):
    """``script args`` in a process of its own that SIGKILLs itself when training step ``step`` is done,
    before it is logged (a hook installed by tests/support/killed_run.py)."""
    result = subprocess.run([sys.executable, "tests/support/killed_run.py", str(step), script, *args], cwd=ROOT,
                            env=_user_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    return result


@contextlib.contextmanager
def _one_process(script, out_dir, timeout=400):
    """``run(args)``: ``script args`` as from the command line, each run in turn in one process of the
    script's own (tests/support/script_runs.py), a later run reusing what an earlier one compiled;
    the run's stdout and stderr, as a process of its own would have printed them (its exit status 0)."""
    out_dir.mkdir()
    with open(out_dir / "process.err", "w") as err:
        process = subprocess.Popen([sys.executable, "tests/support/script_runs.py", script, str(out_dir)], cwd=ROOT,
                                   env=_user_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                   text=True)
    runs = []

    def run(args):
        process.stdin.write(json.dumps(args) + "\n")
        process.stdin.flush()
        done, _, _ = select.select([process.stdout], [], [], timeout)  # its exit status, a line once the run ends
        assert done, f"{script} {args}: not done within {timeout} s"
        reply = process.stdout.readline()
        output = [f.read_text() if (f := out_dir / f"{len(runs)}.{kind}").exists() else "" for kind in ("out", "err")]
        assert reply, f"{script} {args}: the process ended\n" + output[1] + (out_dir / "process.err").read_text()
        runs.append(subprocess.CompletedProcess([script, *args], int(reply), *output))
        assert runs[-1].returncode == 0, runs[-1].stdout + runs[-1].stderr
        return runs[-1]

    try:
        yield run
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _records(path, split="train"):
    with open(path) as f:
        return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")}
                for r in map(json.loads, f) if r["split"] == split]


def _checksums(ckpt_dir):
    """The recorded checksum of every array of the newest checkpoint: equal = bit-identical states."""
    from ringsplash import checkpoints

    return [leaf.checksum for leaf in checkpoints.read_metadata(str(ckpt_dir)).leaves]


def _no_orbax_data_warning_in(text):
    assert "could not be restored" not in text, text


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Tiny byte corpora: training documents and other, held-out documents."""
    from ringsplash import data

    root = tmp_path_factory.mktemp("corpora")
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))  # the stdlib's json package
    data.tokenize_corpus(files[:-1], str(root / "train"), progress=False)
    data.tokenize_corpus(files[-1:], str(root / "heldout"), progress=False)
    return str(root / "train"), str(root / "heldout")


# ------------------------------------------------------------------------------------ kill, resume, continue


def _table(stdout):
    """The held-out loss-by-position table byte_lm prints."""
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("held-out loss by position"))
    last = next(i for i, line in enumerate(lines) if line.startswith("plots:"))
    return lines[first:last]


@pytest.mark.e2e
def test_byte_lm_killed_resumes_to_the_uninterrupted_state_and_continues(corpora, tmp_path):
    # as a user runs them, from the command line in processes of the script's own (the test run compiles
    # some programs with other XLA:CPU options than a script does: tests/conftest.py): the killed run and the
    # refused one each alone; the resumed, uninterrupted and continued runs one after another in one process
    # (the resumed run first, so it resumes in a fresh process; the others reuse its compiled programs)
    train_path, heldout_path = corpora
    tiny = ["--data", train_path, "--heldout", heldout_path, "--seq-len", "256", "--d-model", "32", "--num-layers",
            "1", "--num-heads", "2", "--attention", "ring", "--context-parallel", "2", "--steps", "4",
            "--batch-size", "2", "--warmup-steps", "1", "--eval-batches", "1", "--checkpoint-every", "2",
            "--log-every", "1", "--no-progress"]
    run = lambda name: [*tiny, "--run-dir", str(tmp_path / name)]
    cut = _killed("byte_lm", run("cut"), step=3)  # after the step-2 checkpoint
    assert "devices: 2 x cpu (platform cpu, 1 process)" in cut.stdout
    assert "libtpu" not in cut.stderr and "TPU_WORKER_HOSTNAMES" not in cut.stderr, cut.stderr
    assert [r["step"] for r in _records(tmp_path / "cut" / "metrics.jsonl")] == [1, 2]

    with _one_process("byte_lm", tmp_path / "runs") as one_process:
        resumed = one_process(run("cut"))
        full = one_process(run("full"))
        assert "(resuming from its checkpoint); step 2 of 4" in resumed.stdout
        _no_orbax_data_warning_in(resumed.stderr)  # the data iterator's state is restored; orbax's warning gone
        # parameters, optimiser state and step bit for bit; each step's loss; the held-out loss by position
        assert _checksums(tmp_path / "cut" / "checkpoints") == _checksums(tmp_path / "full" / "checkpoints")
        assert _records(tmp_path / "cut" / "metrics.jsonl") == _records(tmp_path / "full" / "metrics.jsonl")
        assert _table(resumed.stdout) == _table(full.stdout) and len(_table(full.stdout)) > 2

        more = one_process([*run("cut"), "--steps", "6"])
    assert "continuing from step 4 to 6 steps" in more.stdout
    assert [r["step"] for r in _records(tmp_path / "cut" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert os.path.isdir(tmp_path / "cut" / "checkpoints" / "6")
    back = subprocess.run([sys.executable, "experiments/byte_lm.py", *run("cut"), "--steps", "5"], cwd=ROOT,
                          env=_user_env(), capture_output=True, text=True, timeout=400)
    assert back.returncode == 2
    _one_line_naming(back.stderr, "--steps", "5")  # never back: expected >= 6


@pytest.mark.e2e
def test_extend_context_killed_resumes_to_the_uninterrupted_results_and_continues(corpora, tmp_path):
    # as a user runs them, from the command line in processes of the script's own (the base and the
    # evaluations are one-device programs, which the test run compiles with other XLA:CPU emitters
    # than a script does: tests/conftest.py): the killed run alone; the resumed, uninterrupted and
    # continued runs one after another in one process (the resumed run first, so it resumes in a fresh
    # process; a later run reuses the programs an earlier one compiled: the train steps, the evaluations)
    train_path, heldout_path = corpora
    tiny = ["--data", train_path, "--heldout", heldout_path, "--corpus-dir", str(tmp_path / "corpora"),
            "--base-len", "256", "--factor", "2", "--d-model", "32", "--num-layers", "1", "--num-heads", "2",
            "--methods", "yarn", "--base-steps", "2", "--base-batch", "2", "--finetune-steps", "4",
            "--finetune-batch", "2", "--context-parallel", "2", "--eval-docs", "1", "--passkey-samples", "1",
            "--depths", "0.5", "--checkpoint-every", "2", "--no-progress"]
    run = lambda name: [*tiny, "--run-dir", str(tmp_path / name)]
    # killed at the finetune's step 3 (the base logs steps 1 and 2 only), after its step-2 checkpoint
    cut = _killed("extend_context", run("cut"), step=3)
    assert "devices: 2 x cpu (platform cpu, 1 process)" in cut.stdout
    assert "libtpu" not in cut.stderr and "TPU_WORKER_HOSTNAMES" not in cut.stderr, cut.stderr
    finetune = lambda name: tmp_path / name / "yarn" / "finetune"
    assert [r["step"] for r in _records(finetune("cut") / "metrics.jsonl")] == [1, 2]

    with _one_process("extend_context", tmp_path / "runs") as one_process:
        resumed = one_process(run("cut"))
        one_process(run("full"))
        assert "resuming" in resumed.stdout
        _no_orbax_data_warning_in(resumed.stderr)
        results = lambda name: (tmp_path / name / "results.jsonl").read_text()
        assert results("cut") == results("full")  # perplexity and passkey at every length, both phases
        for part in ("base_model", "yarn/finetune"):  # each trained state bit for bit, each step's loss
            assert _checksums(tmp_path / "cut" / part / "checkpoints") == \
                _checksums(tmp_path / "full" / part / "checkpoints")
            assert _records(tmp_path / "cut" / part / "metrics.jsonl") == \
                _records(tmp_path / "full" / part / "metrics.jsonl")

        # a larger --base-steps continues the base; the finetune then starts again from it (the old one kept)
        more = one_process([*run("cut"), "--base-steps", "3"])
    assert "continuing from step 2 to 3 steps" in more.stdout and "finetuning again" in more.stdout
    assert os.path.isdir(tmp_path / "cut" / "yarn.base2" / "finetune" / "checkpoints" / "4")
    assert [r["step"] for r in _records(tmp_path / "cut" / "base_model" / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in _records(finetune("cut") / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _checksums(finetune("cut") / "checkpoints") != _checksums(finetune("full") / "checkpoints")


# ------------------------------------------------------------------------------------ bad flags


BAD_FLAGS = [
    ("byte_lm", "--attention", "flash"),
    ("byte_lm", "--steps", "x"),
    ("byte_lm", "--block", "100"),
    ("byte_lm", "--data", "runs/corpora/mine"),
    ("train_long_context", "--compute-dtype", "float64"),
    ("train_long_context", "--steps", "0"),
    ("train_long_context", "--curriculum", "16-0.5"),
    ("train_long_context", "--preset", "7b"),
    ("extend_context", "--factor", "1"),
    ("extend_context", "--methods", "none,ntk"),
    ("extend_context", "--param-dtype", "fp8"),
    ("extend_context", "--backend", "tpu"),
    # issue 56 (7): were a ZeroDivisionError / OverflowError traceback, or stages silently never reached
    ("train_long_context", "--curriculum", "0:0.5"),
    ("train_long_context", "--curriculum", "16:inf"),
    ("train_long_context", "--curriculum", "16:0.7,32:0.7"),
    ("train_long_context", "--curriculum", "2048:0.1"),
]


def _one_line_naming(stderr, flag, value):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr  # no traceback, no usage block
    assert flag in lines[0] and value in lines[0], lines[0]
    assert any(word in lines[0] for word in ("expected", "choose one of", "invalid int", "needs")), lines[0]


@pytest.mark.parametrize("script, flag, value", BAD_FLAGS, ids=[" ".join(c) for c in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_the_flag_the_value_and_what_is_accepted(script, flag, value, capsys,
                                                                                 monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    job = _job(script)
    with pytest.raises(SystemExit) as exit_:
        job.run_script(job.main, job.parse_args, [flag, value])
    assert exit_.value.code == 2
    _one_line_naming(capsys.readouterr().err, flag, value)
    assert not os.listdir(tmp_path), "nothing is written before the flags are checked"


def test_byte_lm_data_alone_holds_out_a_tenth_never_trained_on_and_says_how_many(capsys, monkeypatch, tmp_path):
    """``--data`` without ``--heldout``: one in ten of its documents (by a hash of each) is held out and never
    in a training row (two epochs of the loader fit gets: fit is replaced, the run stops there), and the
    run says how many before it trains."""
    import numpy as np

    from ringsplash import data, train
    from support.corpus import documents_in_rows, make_corpus

    corpus = make_corpus(str(tmp_path / "c"), np.random.default_rng(0), n=60, lo=2, hi=60)
    docs = [np.asarray(corpus[i]).astype(np.uint8).tobytes() for i in range(len(corpus))]
    held = data.held_out_documents(corpus)
    heldout_docs = {d for d, h in zip(docs, held) if h}

    class Trained(Exception):
        pass

    def fit(model_config, tc, loader, run_dir, **kwargs):
        seen = documents_in_rows(loader, 2 * loader.sources[0].plan.num_rows)
        assert seen == set(docs) - heldout_docs and not seen & heldout_docs
        raise Trained

    monkeypatch.setattr(train, "fit", fit)
    job = _job("byte_lm")
    with pytest.raises(Trained):
        job.main(job.parse_args(["--data", corpus.path, "--seq-len", "64", "--batch-size", "4", "--attention",
                                 "reference", "--no-progress", "--run-dir", str(tmp_path / "run")]))
    out = capsys.readouterr().out
    assert f"corpus {corpus.path}: {int((~held).sum())} documents trained on, " in out, out
    assert f"; held out: {int(held.sum())} of its 60 documents (one in 10, by a hash of each document's tokens), " \
           f"never trained on" in out, out


def test_a_missing_package_is_one_line_naming_what_to_install(capsys, monkeypatch, tmp_path):
    """byte_lm where Grain is missing (an environment installed before it was a core dependency): one line
    on stderr saying what to install, exit status 1, no traceback (tests/test_optional.py: the extras)."""
    monkeypatch.chdir(tmp_path)
    job = _job("byte_lm")
    monkeypatch.setitem(sys.modules, "grain", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        job.run_script(job.main, job.parse_args, ["--data", "mine", "--heldout", "other", "--no-progress"])
    assert exit_.value.code == 1
    lines = capsys.readouterr().err.splitlines()  # "<program>: error: ...", the program pytest's own here
    assert len(lines) == 1 and lines[0].endswith(": error: ringsplash.data.Loader (tokenized corpora) needs grain: "
                                                 "pip install -e ."), lines


OUTPUT_DIR_FLAGS = [("train_long_context", "--run-dir"), ("byte_lm", "--run-dir"), ("byte_lm", "--corpus-dir"),
                    ("extend_context", "--run-dir"), ("extend_context", "--corpus-dir")]


@pytest.mark.parametrize("script, flag", OUTPUT_DIR_FLAGS, ids=[" ".join(c) for c in OUTPUT_DIR_FLAGS])
def test_an_output_directory_under_a_file_is_one_line_naming_the_flag(script, flag, capsys, monkeypatch, tmp_path):
    """A run directory at or under a regular file: one line naming the flag before anything runs (was: a
    ``NotADirectoryError`` traceback once the run first wrote there)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    job = _job(script)
    for path in ("afile/run", "afile"):
        with pytest.raises(SystemExit) as exit_:
            job.run_script(job.main, job.parse_args, [flag, path])
        assert exit_.value.code == 2
        _one_line_naming(capsys.readouterr().err, flag, path)
    assert os.listdir(tmp_path) == ["afile"]


@pytest.mark.e2e
@pytest.mark.parametrize("script, flag, value", [BAD_FLAGS[0], BAD_FLAGS[5], BAD_FLAGS[10]],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_a_bad_flag_on_the_command_line_exits_with_one_line(script, flag, value, tmp_path):
    result = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, f"{script}.py"), flag, value], cwd=tmp_path,
                            env=_user_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    _one_line_naming(result.stderr, flag, value)


# ------------------------------------------------------------------------------------ platform, dtypes, kernels


@pytest.mark.e2e
def test_start_up_chooses_the_cpu_without_jax_platforms_or_libtpu_and_prints_the_devices():
    code = ("import os; from ringsplash import distributed; print(distributed.choose_platform(3)); "
            "print(distributed.device_line()); print(os.environ.get('JAX_PLATFORMS'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_user_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["cpu", "devices: 3 x cpu (platform cpu, 1 process)", "None"]
    assert "libtpu" not in result.stderr and "TPU_WORKER_HOSTNAMES" not in result.stderr, result.stderr


def test_start_up_leaves_jax_platforms_unset(monkeypatch):
    """In this (already started) process: the choice goes to jax.config, never to the environment."""
    import jax

    from ringsplash import distributed

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", None)
        assert distributed.choose_platform(2) == ("tpu" if distributed.tpu_present() else "cpu")
        assert "JAX_PLATFORMS" not in os.environ
        assert distributed.device_line().startswith(f"devices: {len(jax.devices())} x ")
    finally:
        jax.config.update("jax_platforms", before)


def test_no_script_pins_the_platform_in_the_environment():
    for path in glob.glob(os.path.join(EXPERIMENTS, "*.py")):
        if os.path.basename(path) in ("byte_lm.py", "extend_context.py", "train_long_context.py", "_runtime.py"):
            with open(path) as f:
                source = f.read()
            assert 'environ.setdefault("JAX_PLATFORMS"' not in source and 'environ["JAX_PLATFORMS"]' not in source, path


def test_tpu_is_detected_from_its_device_files(monkeypatch):
    from ringsplash import distributed

    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(distributed.os.path, "isdir", lambda path: path == "/dev/vfio")
    monkeypatch.setattr(distributed.os, "listdir", lambda path: ["vfio"])  # the control file only: no TPU
    assert not distributed.tpu_present()
    monkeypatch.setattr(distributed.os, "listdir", lambda path: ["vfio", "0", "1"])  # v5p / v6e: numbered groups
    assert distributed.tpu_present()
    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    monkeypatch.setattr(distributed.os.path, "isdir", lambda path: False)
    assert distributed.tpu_present()  # v2 - v5e


def test_context_parallel_auto_is_the_simulated_devices_on_cpu_and_every_device_on_a_tpu(monkeypatch):
    """``--context-parallel 0`` (the default): 4 (8 for extend_context) simulated CPU devices, or every
    device of a TPU over the other mesh axes; a count given is kept; the model config refuses 0."""
    import jax

    from ringsplash import distributed

    main_job, byte_lm = _job("train_long_context"), _job("byte_lm")
    runtime = sys.modules["_runtime"]
    default = main_job.parse_args([])
    assert default.context_parallel == 0
    assert runtime.choose_devices(default, cpu_context=4).context_parallel == 4  # this process: the CPU
    monkeypatch.setattr(distributed, "choose_platform", lambda cpu_devices=1: "tpu")
    for devices, other, expected in ((1, 1, 1), (8, 1, 8), (8, 2, 4)):
        monkeypatch.setattr(jax, "device_count", lambda devices=devices: devices)
        assert runtime.choose_devices(default, cpu_context=4, other=other).context_parallel == expected
    assert runtime.choose_devices(main_job.parse_args(["--context-parallel", "2"]), cpu_context=4).context_parallel == 2
    splash = byte_lm.parse_args(["--attention", "splash"])
    assert runtime.choose_devices(splash, cpu_context=4, shards_context=False).context_parallel == 1
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--context-parallel 0 is not accepted: expected a device count: 1 devices"):
        runtime.choose_devices(default, cpu_context=4, other=2)
    with pytest.raises(ValueError, match=r"--context-parallel 0 \(auto\) is resolved by main\(\)"):
        main_job.make_model_config(default, 100)


def test_compute_dtype_defaults_to_bfloat16_on_a_tpu_in_every_experiment(monkeypatch):
    """One rule (``_runtime.compute_dtype``) for the three experiments: ``--compute-dtype auto`` (the
    default) computes in bfloat16 on a TPU (and when extend_context preflights one), float32 elsewhere;
    a dtype given is kept. Before 2026-12-07 extend_context trained its base model in float32 on a v5e."""
    import jax

    byte_lm, main_job, extend = _job("byte_lm"), _job("train_long_context"), _job("extend_context")
    runtime = sys.modules["_runtime"]
    builders = [lambda argv: byte_lm.model_config(runtime.choose_devices(byte_lm.parse_args(argv), cpu_context=4)),
                lambda argv: main_job.make_model_config(
                    runtime.choose_devices(main_job.parse_args(argv), cpu_context=4), 100),
                lambda argv: extend.base_model_config(extend.parse_args(argv), 100)]
    assert [build([]).compute_dtype for build in builders] == ["float32"] * 3  # this host computes on the CPU
    assert extend.base_model_config(extend.parse_args(["--preflight", "v5e:2x2"]), 100).compute_dtype == "bfloat16"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert [build([]).compute_dtype for build in builders] == ["bfloat16"] * 3
    assert [build(["--compute-dtype", "float32"]).compute_dtype for build in builders] == ["float32"] * 3
    assert [c.param_dtype for c in (build([]) for build in builders)] == ["float32"] * 3


def test_dtype_backend_and_block_flags_reach_the_model_config():
    dtypes = ["--param-dtype", "float32", "--compute-dtype", "bfloat16"]
    byte_lm, main_job, extend = _job("byte_lm"), _job("train_long_context"), _job("extend_context")
    runtime = sys.modules["_runtime"]
    # --context-parallel 0 (auto) is resolved by each main(), as here (this process computes on the CPU)
    kernel = ["--block", "256", "--backend", "xla"]
    byte_cfg, main_cfg, extend_cfg = (runtime.choose_devices(job.parse_args(argv), cpu_context=4) for job, argv in
                                      ((byte_lm, dtypes + kernel), (main_job, dtypes + kernel), (extend, kernel)))
    configs = [
        byte_lm.model_config(byte_cfg),
        main_job.make_model_config(main_cfg, 100),
        extend.base_model_config(extend.parse_args(dtypes + kernel), 100),
    ]
    for c in configs:
        assert (c.param_dtype, c.compute_dtype) == ("float32", "bfloat16")
        assert (c.splash.backend, c.splash.block_q, c.splash.block_kv, c.splash.block_kv_dkv) == ("xla", 256, 256, 256)
    ring = extend.on_ring(configs[2], extend_cfg)
    assert (ring.splash.backend, ring.splash.block_q) == ("xla", 256)
    # by default: the fast choice for the platform (auto backend, tuned blocks), float32
    defaults = [byte_lm.model_config(runtime.choose_devices(byte_lm.parse_args([]), cpu_context=4)),
                main_job.make_model_config(runtime.choose_devices(main_job.parse_args([]), cpu_context=4), 100),
                extend.base_model_config(extend.parse_args([]), 100)]
    for c in defaults:
        assert (c.param_dtype, c.compute_dtype, c.splash.backend) == ("float32", "float32", "auto")
        assert c.splash.tuned and c.splash.block_q is None
