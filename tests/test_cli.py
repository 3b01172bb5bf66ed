import argparse
import ast
import dataclasses
import importlib.util
import pathlib
import sys

import pytest

from ringsplash.cli import config_parser, field_help, parse_config


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


# ---------------------------------------------------------------------------------------------
# Every entry point: help on every flag, no abbreviations (in process: no subprocess, no JAX start)

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRY_DIRS = ("experiments", "scripts")
# fields whose 0 is an ordinary value, not "auto" / "off" / "none"
ORDINARY_ZERO = {"seed"}


def _entry_points(needle: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for d in ENTRY_DIRS for p in (ROOT / d).rglob("*.py")
                  if needle in p.read_text())


CONFIG_ENTRY_POINTS = _entry_points("parse_config(")
PARSER_ENTRY_POINTS = _entry_points("ArgumentParser(")


def _load(relative_path: str):
    """The module at ``relative_path``, registered in ``sys.modules`` (``inspect.getsource`` reads
    a class's comments through its module)."""
    name = "_cli_entry_" + relative_path.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.path.insert(0, str((ROOT / relative_path).parent))  # scripts import their _bench helper
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    return sys.modules[name]


def _config_class(relative_path: str):
    """The dataclass ``relative_path`` passes to ``parse_config``."""
    calls = [n for n in ast.walk(ast.parse((ROOT / relative_path).read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "parse_config"]
    assert len(calls) == 1, f"{relative_path}: expected one parse_config call, found {len(calls)}"
    return getattr(_load(relative_path), calls[0].args[0].id)


def test_entry_points_found():
    assert {"experiments/byte_lm.py", "experiments/train_long_context.py", "experiments/mask_demo.py",
            "experiments/strategy_equivalence.py", "scripts/aot_preflight.py"} <= set(CONFIG_ENTRY_POINTS)
    assert {"scripts/launch_local.py", "scripts/tpu/launch.py", "scripts/bench_ring.py"} <= set(PARSER_ENTRY_POINTS)


@pytest.mark.parametrize("path", CONFIG_ENTRY_POINTS)
def test_every_config_field_has_a_help_line(path):
    config_cls = _config_class(path)
    helps = field_help(config_cls)
    missing = [f.name for f in dataclasses.fields(config_cls) if not helps[f.name]]
    assert not missing, f"{path}: {config_cls.__name__} fields without a comment (their --help line): {missing}"
    for f in dataclasses.fields(config_cls):
        special = {0: "0 =", None: "None =", "": '"" ='}
        if f.name not in ORDINARY_ZERO and not isinstance(f.default, bool) and f.default in special:
            assert special[f.default] in helps[f.name], (
                f"{path}: {f.name} defaults to {f.default!r}; its comment must say what that means "
                f"('{special[f.default]} ...'), got {helps[f.name]!r}")
    parser = config_parser(config_cls, [])
    assert not parser.allow_abbrev
    text = parser.format_help()
    for f in dataclasses.fields(config_cls):
        assert "--" + f.name.replace("_", "-") in text


@pytest.mark.parametrize("path", CONFIG_ENTRY_POINTS)
def test_config_entry_point_help_and_abbreviations(path, capsys):
    module = _load(path)
    config_cls = _config_class(path)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    name = dataclasses.fields(config_cls)[0].name
    assert f"--{name.replace('_', '-')}" in out and field_help(config_cls)[name] in " ".join(out.split())
    # a prefix of a flag is an unknown argument, never that flag
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as exit_:
        module.parse_args([flag[:-1], "1"])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {flag[:-1]} 1" in capsys.readouterr().err


PREFLIGHT_BAD_FLAGS = [("--seq-len", "0"), ("--headroom", "-1"), ("--headroom", "nan"), ("--headroom", "1.5"),
                       ("--hf-config", "no/such/config.json"), ("--block", "100"), ("--context-parallel", "-1"),
                       ("--mlp-ratio", "inf"), ("--layout", "spiral")]


@pytest.mark.parametrize("flag, value", PREFLIGHT_BAD_FLAGS, ids=[" ".join(c) for c in PREFLIGHT_BAD_FLAGS])
def test_aot_preflight_refuses_a_bad_flag_in_one_line_naming_it(flag, value, capsys):
    """Issue 56 (7): ``--seq-len 0`` named ``max_seq_len`` (the model config's field), a missing ``--hf-config``
    was a traceback, ``--headroom -1`` was accepted; now each is one line naming the flag, exit status 2."""
    module = _load("scripts/aot_preflight.py")
    with pytest.raises(SystemExit) as exit_:
        module.run_script(module.main, module.parse_args, [flag, value])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{flag} " in lines[0] and value in lines[0] and "expected" in lines[0], lines


@pytest.mark.parametrize("path", ["experiments/byte_lm.py", "experiments/extend_context.py"])
def test_experiments_refuse_a_seed_the_data_loader_cannot_take_when_parsed(path, capsys):
    """``--seed 2147483648`` (2**31) was accepted when parsed and failed only once the corpora had been read (and,
    with extend_context --init-from, the base model loaded), as ``seed=2147483648 must be in [0, 2**31)``, naming
    no flag; byte_lm's held-out loader (seed + 1) failed so for --seed 2147483647 too. Now one line naming --seed
    before anything runs."""
    module = _load(path)

    def never(config, hooks=()):
        raise AssertionError("main ran")

    with pytest.raises(SystemExit) as exit_:
        module.run_script(never, module.parse_args, ["--seed", str(2**31)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--seed 2147483648 is not accepted: expected an integer in [0, 2147483647]" in lines[0]
    assert module.parse_args(["--seed", str(2**31 - 1)]).seed == 2**31 - 1


def test_byte_lm_refuses_a_prefix_of_data_parallel_as_an_abbreviation(capsys):
    module = _load("experiments/byte_lm.py")
    with pytest.raises(SystemExit):
        module.parse_args(["--data-par", "2"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --data-par 2" in err
    # --data is the corpus flag itself (with its held-out corpus)
    assert module.parse_args(["--data", "my_corpus", "--heldout", "other"]).data == "my_corpus"
    # the preset pre-parser does not take a prefix of --preset either
    with pytest.raises(SystemExit):
        module.parse_args(["--pre", "tiny"])
    assert "unrecognized arguments: --pre tiny" in capsys.readouterr().err


@pytest.mark.parametrize("path", PARSER_ENTRY_POINTS)
def test_script_parser_help_on_every_flag_and_no_abbreviations(path, capsys):
    module = _load(path)
    assert hasattr(module, "build_parser"), f"{path} builds an ArgumentParser: expose it as build_parser()"
    parser = module.build_parser()
    assert not parser.allow_abbrev, f"{path}: ArgumentParser(..., allow_abbrev=False)"
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:  # internal flags (child processes)
            continue
        assert action.help and action.help.strip() and "\n" not in action.help, (
            f"{path}: {action.option_strings or action.dest} needs a one-line help")
    parser.format_help()  # every help's %(default)s formats
    longest = max((s for a in parser._actions for s in a.option_strings), key=len)
    prefix = longest[:-1]
    positional = ["x.py"] if any(not a.option_strings for a in parser._actions) else []
    with pytest.raises(SystemExit):
        parser.parse_args([prefix, "1", *positional])
    assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_every_argument_parser_refuses_abbreviations():
    """Any ``ArgumentParser(...)`` call in the library, scripts or experiments passes ``allow_abbrev=False``."""
    offenders = []
    for d in ("src", *ENTRY_DIRS):
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "ArgumentParser"
                                                   or getattr(node.func, "id", None) == "ArgumentParser"):
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False):
                        offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"ArgumentParser without allow_abbrev=False: {offenders}"


# ---------------------------------------------------------------------------------------------
# field_help: where a field's help line comes from


@dataclasses.dataclass(frozen=True)
class _Base:
    """Base config.

    Attributes:
        inherited: from the docstring
        ``ticked``: also from the docstring
    """

    inherited: int = 1
    ticked: int = 2


@dataclasses.dataclass(frozen=True)
class _Commented(_Base):
    trailing: int = 3  # a trailing comment
    #: a comment line above,
    #: continued
    above: str = "x"
    # a plain section comment is not a field's help
    bare: float = 0.5
    multi: tuple = (  # on the first line
        1, 2)
    percent: int = 4  # 100% sure


def test_field_help_sources():
    helps = field_help(_Commented)
    assert helps == {"inherited": "from the docstring", "ticked": "also from the docstring",
                     "trailing": "a trailing comment", "above": "a comment line above, continued", "bare": "",
                     "multi": "on the first line", "percent": "100% sure"}
    # a '%' in a comment is text, not a format
    assert "100% sure (default: 4)" in " ".join(config_parser(_Commented, []).format_help().split())


def test_field_help_without_source_is_empty():
    namespace = {"dataclasses": dataclasses}
    exec("@dataclasses.dataclass\nclass Made:\n    x: int = 1  # invisible\n", namespace)
    assert field_help(namespace["Made"]) == {"x": ""}
    assert parse_config(namespace["Made"], ["--x", "2"]).x == 2
