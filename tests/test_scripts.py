"""Scripts and the main job: AOT preflight for a TPU topology, the launcher's dry run, and the
main experiment end to end: a smoke run, and a run killed after a periodic checkpoint and
resumed, which must end bit for bit where an uninterrupted run ends."""

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from support.processes import child_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY = ["--seq-len", "2048", "--d-model", "256", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1",
        "--vocab-size", "512", "--block", "256"]

pytestmark = pytest.mark.e2e


def _run(args, timeout=300):
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.tpu_compile
def test_aot_preflight_compiles_tiny_config_for_v5e():
    result = _run(["scripts/aot_preflight.py", "--topology", "v5e:2x2", *TINY])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "topology v5e:2x2" in out and "context=4" in out
    for line in ("arguments", "ring schedule", "outputs", "temporaries", "total"):
        assert line in out
    assert "of 16.000 GiB per device" in out and out.strip().endswith("FITS")


@pytest.mark.tpu_compile
def test_aot_preflight_exits_nonzero_when_it_does_not_fit():
    # replicated parameters + AdamW state (1.6 B params x 12 bytes per device); FSDP would fit it
    result = _run(["scripts/aot_preflight.py", "--topology", "v5e:2x2", *TINY, "--d-model", "4096",
                   "--num-heads", "32", "--num-kv-heads", "32", "--num-layers", "8", "--no-fsdp"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DOES NOT FIT" in result.stdout


@pytest.mark.tpu_compile
def test_aot_preflight_small_preset_with_fsdp_for_v5e():
    """The tiny preset (head_dim raised to the TPU kernels' 128) with sharded params + AdamW
    state, a selective remat policy and a chunked loss compiles for v5e:2x2; the report splits
    the arguments and shows FSDP's per-device share of the state."""
    result = _run(["scripts/aot_preflight.py", "--topology", "v5e:2x2", "--preset", "tiny", "--head-dim", "128",
                   "--seq-len", "2048", "--block", "256", "--fsdp", "--remat", "save_attention", "--loss-chunk", "256"])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "remat=save_attention; loss_chunk=256" in out
    assert "sharded (FSDP) over data x context = 4 devices" in out
    assert "params + optimiser state = 1.000 x (replicated bytes / devices" in out  # every tiny dim divides 4
    for line in ("parameters", "optimiser state", "batch shard", "logits of one loss chunk", "temporaries"):
        assert line in out
    assert out.strip().endswith("FITS")


def test_aot_preflight_rejects_an_unknown_preset_and_topology_in_one_line():
    result = _run(["scripts/aot_preflight.py", "--preset", "7b"])
    assert result.returncode == 2 and "choose one of ('tiny', '1b', 'llama3-8b')" in result.stderr
    result = _run(["scripts/aot_preflight.py", "--topology", "v9x:1x1"])
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "aot_preflight.py: error: --topology 'v9x:1x1' is not accepted"), result.stderr
    assert "Traceback" not in result.stderr


def _preflight_module():
    spec = importlib.util.spec_from_file_location("aot_preflight", os.path.join(ROOT, "scripts", "aot_preflight.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.cheap  # no compile: a predicate stands in for "the step fits"
def test_aot_preflight_search_finds_the_largest_value_that_fits():
    """--find-max-seq-len / --find-max-layers: doubling from the start (halving when it does not fit), then
    bisection in steps; each candidate tried once."""
    largest = _preflight_module()._largest
    for limit, start, step, cap, want in [(45, 8, 1, 512, (45, False)), (3, 8, 1, 512, (3, False)),
                                          (100_000, 32768, 128, 1 << 24, (99_968, False)), (0, 8, 1, 512, (0, False)),
                                          (10**9, 8, 1, 512, (512, True)), (1, 8, 1, 512, (1, False))]:
        tried = []

        def fits(x, limit=limit, tried=tried, step=step):
            assert x % step == 0 and x >= step and x not in tried
            tried.append(x)
            return x <= limit

        assert largest(fits, start, step, cap) == want, (limit, start, tried)


@pytest.mark.tpu_compile
def test_aot_preflight_finds_the_most_layers_for_one_v5e_chip():
    """--find-max-layers on v5e:1x1 (one chip): a model whose HBM use grows with its layers stops where the
    next layer no longer fits the 90% headroom; the report is printed at the most that fit."""
    # ~4.3 GB of parameters and AdamW state per layer (d_model 4096, float32): 3 fit in 90% of 16 GiB, 4 do not.
    # From 3 layers the search tries 3 (fits), 6 (the compiler refuses it at once: over HBM), then 4 (compiled,
    # over the headroom): two full compiles of ~16 s, where from 2 layers it compiled 2, 4 and 3
    result = _run(["scripts/aot_preflight.py", "--topology", "v5e:1x1", "--seq-len", "1024", "--d-model", "4096",
                   "--num-heads", "32", "--num-kv-heads", "32", "--vocab-size", "512", "--num-layers", "3",
                   "--context-parallel", "1", "--no-fsdp", "--find-max-layers"], timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    most = int(re.search(r"most layers that fit: (\d+)", out).group(1))
    assert most == 3 and f"num_layers {most:>9d}: fits" in out and f"num_layers {most + 1:>9d}: does not fit" in out, out
    assert re.search(r"num_layers +6: does not fit \(-; RESOURCE_EXHAUSTED", out), out  # the compiler's own refusal
    assert "topology v5e:1x1 (TPU v5 lite, 1 devices)" in out and out.strip().endswith("FITS")


@pytest.mark.cheap  # prints the commands, starts nothing heavy
def test_launch_dry_run_prints_the_commands():
    result = _run(["scripts/tpu/launch.py", "--tpu", "pod", "--zone", "us-east5-b", "--project", "p", "--dry-run",
                   "experiments/train_long_context.py", "--", "--context-parallel", "8", "--backend", "auto"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("tar czf /tmp/ringsplash-src.tar.gz")
    assert lines[1].startswith("gcloud compute tpus tpu-vm scp /tmp/ringsplash-src.tar.gz pod:")
    assert "--worker=all" in lines[1] and "--zone=us-east5-b" in lines[1] and "--project=p" in lines[1]
    assert "gcloud compute tpus tpu-vm ssh pod --worker=all" in lines[2] and "pip install -q -e" in lines[2]
    assert "[tpu]" in lines[2]
    # the same worker entry point as scripts/launch_local.py (tested end to end in test_multiprocess.py)
    assert ("JAX_PLATFORMS=tpu RINGSPLASH_TPU_MULTIHOST=1 python3 -m ringsplash.distributed "
            "experiments/train_long_context.py --") in lines[3]
    assert "--context-parallel 8 --backend auto" in lines[3]


def _load(relative_path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_smoke(tmp_path):
    job = _load("experiments/train_long_context.py", "train_long_context")

    config = job.Config(steps=6, batch_size=2, d_model=32, eval_batches=1, eval_every=0, warmup_steps=2,
                        curriculum="32:0.5", run_dir=str(tmp_path / "run"), progress=False)
    result = job.main(config)
    assert result["chance"] == 1 / 16
    # The returned accuracy is the held-out evaluation logged at the last step, a whole number of
    # the 1 x 2 x 32 scored answers.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in records if r["split"] == "eval"][-1]
    assert last_eval["step"] == 6 and last_eval["accuracy"] == result["heldout_accuracy"]
    assert abs(result["heldout_accuracy"] * 64 - round(result["heldout_accuracy"] * 64)) < 1e-9
    assert os.path.exists(result["plot"]) and os.path.exists(tmp_path / "run" / "metrics.jsonl")
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "6")  # the final (orbax) checkpoint, step 6
    assert job.curriculum(job.Config())[0] == (0, 16) and job.curriculum(job.Config())[-1][1] == 1024


def test_main_job_help():
    result = _run(["experiments/train_long_context.py", "--help"], timeout=60)
    assert result.returncode == 0 and "--context-parallel" in result.stdout and "--attention" in result.stdout


# The main job at its smallest: ring over 2 devices (zigzag needs seq_len % (2 x 2 x 128) == 0),
# a curriculum switch at step 4 (so the data stream's position matters), 8 steps.
MAIN_TINY = ["--seq-len", "512", "--num-pairs", "4", "--num-queries", "4", "--num-keys", "8", "--num-values", "4",
             "--num-filler", "4", "--curriculum", "16:0.5", "--d-model", "16", "--num-layers", "1",
             "--context-parallel", "2", "--block", "128", "--steps", "8", "--batch-size", "2", "--warmup-steps", "2",
             "--eval-batches", "1", "--eval-every", "4", "--log-every", "1", "--checkpoint-every", "4",
             "--no-progress"]


def _user_env():
    """A user's environment on a CPU machine: no JAX_PLATFORMS, none of the test run's TPU settings."""
    env = child_env()
    for name in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES"):
        env.pop(name, None)
    return env


def _main_job(run_dir, kill_at_step=None):
    """The main job in a process of its own; ``kill_at_step``: it SIGKILLs itself when that training
    step is done, before it is logged (a hook installed by tests/support/killed_run.py)."""
    env = _user_env()  # the script chooses the CPU itself (no TPU here), and says so
    script = ["experiments/train_long_context.py"] if kill_at_step is None else \
        ["tests/support/killed_run.py", str(kill_at_step), "train_long_context"]
    args = [sys.executable, *script, *MAIN_TINY, "--run-dir", str(run_dir)]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_main_job_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path, capsys):
    job = _load("experiments/train_long_context.py", "train_long_context")
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    # The uninterrupted run (here, in the test process), then the run killed (SIGKILL, no clean-up,
    # a process of its own) when step 6 is done (before it is logged), i.e. after the periodic checkpoint of step 4 and
    # the metrics of step 5; then resumed here (the uninterrupted run's compiled step serves it).
    full = job.main(job.parse_args([*MAIN_TINY, "--run-dir", str(full_dir)]))
    cut = _main_job(cut_dir, kill_at_step=6)
    cut_out, cut_err = cut.communicate(timeout=240)
    assert cut.returncode == -signal.SIGKILL, cut_out + cut_err
    assert "devices: 2 x cpu (platform cpu, 1 process)" in cut_out  # the device line, at start
    assert "libtpu" not in cut_err and "TPU_WORKER_HOSTNAMES" not in cut_err, cut_err  # libtpu never started
    assert [r["step"] for r in _records(cut_dir) if r["split"] == "train"] == [1, 2, 3, 4, 5]
    assert os.path.isdir(cut_dir / "checkpoints" / "4")

    capsys.readouterr()
    resumed = job.main(job.parse_args([*MAIN_TINY, "--run-dir", str(cut_dir)]))
    assert "resuming from its checkpoint" in capsys.readouterr().out

    # Parameters, optimiser state and step: identical bit for bit (sha256 over every array).
    assert resumed["state_digest"] == full["state_digest"]
    # Metrics: step 5 (past the checkpoint) was dropped and written again, no step twice, and
    # every logged number (losses of each step's batch, held-out evaluations) as uninterrupted.
    key = lambda r: (r["step"], r["split"])
    strip = lambda r: {k: v for k, v in r.items() if k not in ("time", "tokens_per_s")}
    got, want = sorted(map(strip, _records(cut_dir)), key=key), sorted(map(strip, _records(full_dir)), key=key)
    assert [key(r) for r in got] == [key(r) for r in want] == sorted({key(r) for r in want})
    assert got == want

    # Continued to more steps (a larger --steps on the finished run): from its step-8 checkpoint to
    # step 10, the curriculum as it was laid out over the first 8 steps (past it: whole rows).
    capsys.readouterr()
    more = job.main(job.parse_args([*MAIN_TINY, "--run-dir", str(cut_dir), "--steps", "10"]))
    out = capsys.readouterr().out
    assert "continuing from step 8 to 10 steps (started for 8)" in out and "curriculum [(0, 16), (4, 512)]" in out
    assert [r["step"] for r in _records(cut_dir) if r["split"] == "train"] == list(range(1, 11))
    assert os.path.isdir(cut_dir / "checkpoints" / "10") and more["state_digest"] != full["state_digest"]
    with pytest.raises(ValueError, match=r"--steps 9 is not accepted: expected >= 10"):  # never back
        job.main(job.parse_args([*MAIN_TINY, "--run-dir", str(cut_dir), "--steps", "9"]))


def test_main_job_resume_with_a_different_config_names_the_fields(tmp_path):
    job = _load("experiments/train_long_context.py", "train_long_context")
    config = job.parse_args([*MAIN_TINY, "--run-dir", str(tmp_path)])
    from ringsplash import train

    train.check_run_config(str(tmp_path / "job_config.json"), job.job_config(config, config.steps))
    # steps may change (a run continues to more steps); the model may not
    changed = dataclasses.replace(config, d_model=32, steps=9, checkpoint_every=2, progress=True)
    with pytest.raises(ValueError, match=r"different config.*: d_model: 16 vs 32$"):
        job.main(changed)
