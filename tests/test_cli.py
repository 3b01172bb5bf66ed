import dataclasses

import pytest

from ringsplash.cli import parse_config


@dataclasses.dataclass(frozen=True)
class _Config:
    steps: int = 10
    rate: float = 0.5
    name: str = "run"
    progress: bool = True
    window: int | None = None


def test_parse_config_defaults_and_flags():
    assert parse_config(_Config, []) == _Config()
    got = parse_config(_Config, ["--steps", "3", "--rate", "0.25", "--name", "x", "--no-progress", "--window", "64"])
    assert got == _Config(steps=3, rate=0.25, name="x", progress=False, window=64)


def test_parse_config_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        parse_config(_Config, ["--steps", "many"])
    assert "--steps" in capsys.readouterr().err
