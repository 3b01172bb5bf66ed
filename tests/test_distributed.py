"""The multi-process entry point in one process: the launcher's environment, config digests, the
single-process no-ops and running a script as ``__main__`` (several processes: test_multiprocess.py)."""

import dataclasses
import sys

import pytest

from ringsplash import distributed


@dataclasses.dataclass(frozen=True)
class _Config:
    steps: int = 8
    name: str = "run"


def test_local_launch_env_names_every_variable():
    env = distributed.local_launch_env("localhost:1234", 2, 1, 4)
    assert env == {"RINGSPLASH_COORDINATOR": "localhost:1234", "RINGSPLASH_NUM_PROCESSES": "2",
                   "RINGSPLASH_PROCESS_ID": "1", "RINGSPLASH_LOCAL_DEVICES": "4",
                   "RINGSPLASH_HEARTBEAT_TIMEOUT": str(distributed.HEARTBEAT_TIMEOUT)}


def test_a_started_process_keeps_every_xla_flag_but_the_device_count():
    flags = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8  --xla_cpu_use_fusion_emitters=false"
    assert distributed.inherited_xla_flags(flags) == "--xla_dump_to=/tmp/d --xla_cpu_use_fusion_emitters=false"
    assert distributed.inherited_xla_flags("--xla_force_host_platform_device_count=4") == ""
    assert distributed.inherited_xla_flags(None) == ""


def test_timeouts_come_from_the_environment_and_are_checked(monkeypatch):
    monkeypatch.setenv(distributed.ENV_HEARTBEAT_TIMEOUT, "7")
    monkeypatch.delenv(distributed.ENV_SHUTDOWN_TIMEOUT, raising=False)
    got = distributed.timeouts()
    assert got["heartbeat_timeout_seconds"] == 7 and got["shutdown_timeout_seconds"] == distributed.SHUTDOWN_TIMEOUT
    for bad in ("0", "ten"):
        monkeypatch.setenv(distributed.ENV_HEARTBEAT_TIMEOUT, bad)
        with pytest.raises(ValueError, match="RINGSPLASH_HEARTBEAT_TIMEOUT"):
            distributed.timeouts()


def test_launched_locally_reads_the_coordinator_variable(monkeypatch):
    monkeypatch.delenv(distributed.ENV_COORDINATOR, raising=False)
    assert not distributed.launched_locally()
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "localhost:1234")
    assert distributed.launched_locally()


def test_config_digest_is_stable_and_tells_configs_apart():
    digest = distributed.config_digest(_Config())
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert digest == distributed.config_digest(_Config()) == distributed.config_digest({"name": "run", "steps": 8})
    assert digest != distributed.config_digest(_Config(steps=9))


def test_single_process_checks_are_no_ops():
    distributed.check_same_config(_Config())  # one process: nothing to compare, never raises
    assert distributed.agree_on("run-2026") == "run-2026"
    assert distributed.is_main_process()


def test_run_script_runs_it_as_main_with_its_args(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_script sets the script's argv
    out = tmp_path / "out.txt"
    script = tmp_path / "script.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))\n")
    distributed.main([str(script), "--", str(out), "a", "b"])
    assert out.read_text() == "a b"


def test_main_without_a_script_prints_the_usage():
    with pytest.raises(SystemExit, match=r"usage: python -m ringsplash\.distributed SCRIPT"):
        distributed.main([])
