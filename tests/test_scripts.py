"""Scripts and the main job: AOT preflight for a TPU topology, the launcher's dry run, and the
main experiment end to end in a smoke setting."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY = ["--seq-len", "2048", "--d-model", "256", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1",
        "--vocab-size", "512", "--block", "256"]


def _run(args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.tpu_compile
def test_aot_preflight_compiles_tiny_config_for_v5e():
    result = _run(["scripts/aot_preflight.py", "--topology", "v5e:2x2", *TINY])
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "topology v5e:2x2" in out and "context=4" in out
    for line in ("arguments", "outputs", "temporaries", "total"):
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


def test_aot_preflight_rejects_an_unknown_preset():
    result = _run(["scripts/aot_preflight.py", "--preset", "7b"])
    assert result.returncode == 2 and "choose one of ('tiny', '1b', 'llama3-8b')" in result.stderr


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
    assert "JAX_PLATFORMS=tpu python3 scripts/tpu/launch.py --worker-entry experiments/train_long_context.py" in lines[3]
    assert "--context-parallel 8 --backend auto" in lines[3]


def test_launch_worker_entry_initialises_distributed():
    source = open(os.path.join(ROOT, "scripts/tpu/launch.py")).read()
    assert "jax.distributed.initialize()" in source


def test_main_job_smoke(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import train_long_context as job

    config = job.Config(steps=6, batch_size=2, d_model=32, eval_batches=1, eval_every=0, warmup_steps=2,
                        curriculum="32:0.5", run_dir=str(tmp_path / "run"), progress=False)
    result = job.main(config)
    assert 0.0 <= result["heldout_accuracy"] <= 1.0 and result["chance"] == 1 / 16
    assert os.path.exists(result["plot"]) and os.path.exists(tmp_path / "run" / "metrics.jsonl")
    assert os.path.exists(tmp_path / "run" / "checkpoint.eqx")
    assert job.curriculum(job.Config())[0] == (0, 16) and job.curriculum(job.Config())[-1][1] == 1024


def test_main_job_help():
    result = _run(["experiments/train_long_context.py", "--help"], timeout=60)
    assert result.returncode == 0 and "--context-parallel" in result.stdout and "--attention" in result.stdout
