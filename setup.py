"""Builds ringsplash with ``ringsplash-lm-eval.pth`` at the top of site-packages (wheel and
editable installs alike), so ``lm_eval --model ringsplash`` finds the adapter: see
``src/_ringsplash_lm_eval.py``. Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "ringsplash-lm-eval.pth"
PTH_SOURCE = os.path.join("src", PTH)


class BuildPyWithPth(build_py):
    """A wheel's files plus the start-up file, at the wheel's root (site-packages)."""

    def run(self):
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .``: the editable wheel (a path entry for src/) plus the start-up file."""

    def _select_strategy(self, name, tag, build_lib):
        return _WithPth(super()._select_strategy(name, tag, build_lib))


class _WithPth:
    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        with open(PTH_SOURCE, "rb") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
