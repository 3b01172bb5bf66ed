"""ringsplash's XLA:CPU flag (ringsplash/_xla_cpu.py): added to XLA_FLAGS once, a user's own value of
the setting kept. What it prevents is tested in test_model_masks.py (ten runs of a two-ring program)."""

import os

from ringsplash import _xla_cpu


def test_scheduler_flag_is_added_once_and_a_users_setting_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    _xla_cpu.apply_flags()
    _xla_cpu.apply_flags()
    assert _xla_cpu.SCHEDULER_FLAG == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {_xla_cpu.SCHEDULER_FLAG}"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    _xla_cpu.apply_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    monkeypatch.delenv("XLA_FLAGS")
    _xla_cpu.apply_flags()
    assert os.environ["XLA_FLAGS"] == _xla_cpu.SCHEDULER_FLAG
