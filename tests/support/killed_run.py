"""``python tests/support/killed_run.py STEP SCRIPT [ARGS...]``: the experiment ``SCRIPT``
(``experiments/<SCRIPT>.py``) run as from the command line, with a ``train.fit`` hook installed
that SIGKILLs the process (no clean-up, as a crash or a preemption) once training step ``STEP``
is done, before it is logged."""

import importlib.util
import os
import signal
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class KillAtStep:
    """A ``train.fit`` hook: SIGKILL this process when step ``step`` is done (every training run
    of the script sees it; the first to reach ``step`` dies)."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, info) -> None:
        if info.step == self.step:
            import jax

            jax.block_until_ready(info.metrics)  # the step is done, as when it is logged
            os.kill(os.getpid(), signal.SIGKILL)

    def on_end(self, state) -> None:
        pass


def main(step: int, script: str, argv: list[str]) -> None:
    path = os.path.join(ROOT, "experiments", f"{script}.py")
    spec = importlib.util.spec_from_file_location(f"_killed_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv[0] = path
    module.run_script(lambda config: module.main(config, hooks=[KillAtStep(step)]), module.parse_args, argv)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
