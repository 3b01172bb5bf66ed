"""The head sizes every backend and strategy is tested with (one place for the CPU numerics
tests and the TPU compile tests).

``(d, dv)``: q/k head size and v head size (the output's). 64 (Llama-3.2-1B), 96, 192, 256;
MLA-style q/k 192 with v 128; and v larger than q/k. 128 = 128 is what every other test uses.
"""

from typing import NamedTuple

import pytest


class HeadDims(NamedTuple):
    d: int  # q / k head size
    dv: int  # v head size (the output's)


HEAD_DIMS = {
    "d64": HeadDims(64, 64),
    "d96": HeadDims(96, 96),
    "d192": HeadDims(192, 192),
    "d256": HeadDims(256, 256),
    "mla_d192_dv128": HeadDims(192, 128),
    "d64_dv128": HeadDims(64, 128),  # v larger than q/k
}

#: the cases run on the Pallas interpreter (slow on CPU): a size that is not a multiple of 128
#: and v smaller than q/k (MLA); every size runs on the xla backend and compiles for TPU
INTERPRET_HEAD_DIMS = ("d96", "mla_d192_dv128")


def head_dim_params(names=tuple(HEAD_DIMS)):
    """``pytest.param(HeadDims, id=name)`` for ``names``."""
    return [pytest.param(HEAD_DIMS[name], id=name) for name in names]
