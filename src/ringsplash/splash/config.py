"""``SplashConfig``: block sizes and backend choice for the Splash kernels.

Backends:

* ``"mosaic_tpu"`` — the Pallas TPU kernels compiled by Mosaic (TPU lowering only);
* ``"interpret"`` — the same kernels run by a Pallas interpreter (any platform; for
  numerics): the TPU interpreter (``pltpu.InterpretParams``: simulates TPU memory, so reads of
  unwritten memory can show as NaN; slow) or the generic one (``interpret_params="generic"``:
  the kernel body discharged to plain JAX ops; fast, no memory model). See
  ``SplashConfig.interpret_params``;
* ``"xla"`` — the same block-sparse algorithm in plain jnp (``splash/xla.py``);
* ``"auto"`` — ``"mosaic_tpu"`` when the computation is *lowered* for TPU, ``"xla"``
  otherwise. The choice is made at lowering time (``jax.lax.platform_dependent``), so
  compiling for a TPU topology from a CPU host picks the TPU kernels.
"""

import dataclasses
from typing import Any, Literal

import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from ringsplash._internal.scalar_checks import (
    check_bool,
    check_choice,
    check_positive_int,
    check_positive_multiple,
    literal_choices,
)
from ringsplash.splash.tpu_tiles import NUM_LANES
from ringsplash.splash.tuning import tuned_blocks

Backend = Literal["auto", "mosaic_tpu", "interpret", "xla"]
BACKENDS: tuple[str, ...] = literal_choices(Backend)
ProbsDtype = Literal["input", "float32"]
Precision = Literal["auto", "default", "highest"]
PRECISIONS: tuple[str, ...] = literal_choices(Precision)
PartialTiles = Literal["auto", "stored"]
PARTIAL_TILES: tuple[str, ...] = literal_choices(PartialTiles)
GENERIC_INTERPRETER = "generic"
PROBS_DTYPES: tuple[str, ...] = literal_choices(ProbsDtype)


@dataclasses.dataclass(frozen=True)
class SplashConfig:
    """Block sizes (tokens) of the Splash kernels and the backend that runs them.

    Blocks left at None (the default) are tuned: filled, where blocks are fitted to a call,
    from a table measured on the chip JAX computes on (``splash/tuning.py``: per generation,
    kv length, head size and dtype); explicit blocks are honoured.

    ``block_q`` x ``block_kv`` is the forward / dq tile (one MaskInfo block); the forward
    walks each kv block in ``block_kv_compute`` slices to bound the size of the score tile.
    ``block_q_dkv`` x ``block_kv_dkv`` is the dK/dV tile (the transposed MaskInfo).
    ``interpret_params`` picks the interpreter of the ``"interpret"`` backend: a
    ``pltpu.InterpretParams`` (the Pallas TPU interpreter), ``"generic"`` (Pallas' generic
    interpreter), or ``None``: the TPU interpreter with default parameters for single-device
    calls, the generic one inside the context-parallel strategies (``ringsplash.parallel``).
    The TPU interpreter synchronises every simulated device at each kernel; on the CPU client
    that deadlocks unless the client has more threads than the mesh has devices, so the
    strategies refuse it there (use ``"generic"``; both interpreters give the same numerics;
    ``ringsplash.parallel._common.interpreter_for_mesh`` says why). Blocks longer than a sequence
    shrink to its length in ``splash_attention``.

    ``probs_dtype`` is the input dtype of the matmuls that take probabilities or score
    gradients, the same rule in every backend (``interpret`` / ``mosaic_tpu`` / ``xla`` agree
    to float32-accumulation noise under the same setting):

    * ``"input"`` (default) — ``P`` (forward ``P @ V``, backward ``P.T @ dO``) and ``dS``
      (``dS @ K``, ``dS.T @ Q``) are rounded to q's dtype, and so is the other operand.
      With bfloat16 inputs this is the MXU's native bf16 x bf16 -> f32 path on TPU (the fast
      one; several times the float32 matmul rate) at the cost of one bf16 rounding of P and
      dS (relative <= 2^-8, bf16's unit roundoff, per entry; outputs move by about a bf16 unit, gradients by a few).
      With float32 inputs it changes nothing.
    * ``"float32"`` — P and dS stay float32 and the other operand is upcast: the numerics of
      the dense float32 oracle, at the float32 matmul rate on TPU.

    ``vmem_limit_bytes`` is the scoped-VMEM limit the Mosaic kernels compile with: None (default)
    sets each kernel's from an estimate of what it needs (``splash/vmem.py``), refusing at lowering
    a configuration the chip cannot hold; an explicit limit is used as given (and refused if the
    estimate exceeds it).

    ``precision`` is the MXU precision of every matmul of the kernels and the xla backend:

    * ``"auto"`` (default) — ``"highest"`` for float32 inputs, ``"default"`` otherwise: float32
      outputs get float32 accuracy (7.3e-7 max abs at 2K on a v5e against the float32 oracle;
      gradients 1.5e-4, as the xla backend's there, ``docs/tpu.md``) and bfloat16 runs at the
      MXU's bf16 rate. Full precision takes several MXU passes per float32 matmul; its time on
      the chip is not measured yet;
    * ``"default"`` — one bfloat16 pass per matmul: float32 inputs get bfloat16-level error
      (~1e-2 max abs) at about bfloat16 speed;
    * ``"highest"`` — float32 matmuls (several bf16 passes) whatever the input dtype (bfloat16
      operands are exact in one pass, so this changes nothing for them).

    ``segment_skipping`` (default True; only acts when segment ids are given) refines the
    work lists per call from the segment ids: block pairs that share no segment are skipped
    (``splash/segment_blocks.py``), in the kernels, the xla backend and the ring. False runs
    the static lists (for comparison; results are equal either way).

    ``skip_empty_quadrants`` (default True) lets the Pallas kernels skip the parts of banded partial tiles
    (causal, sliding window) that no query attends: the forward's row halves per kv-compute slice, the
    dK/dV kernel's quadrants (``splash/quadrants.py``). It acts on one band over a single device's
    contiguous positions; False computes every partial tile whole (for comparison; results are equal up to
    the rounding of smaller matmuls). On a v5e chip it made the window-4096 forward 5-6% faster at 16K-64K
    (docs/tpu.md).

    ``partial_tiles`` (default ``"auto"``): the Pallas kernels build a banded mask's partial tiles
    (causal, sliding window) from positions, one compare per score (``splash/partial_tiles.py``), on
    every path; ``"stored"`` reads every partial tile from a stored int8 block. ``fused_backward``
    (default True): the Pallas backward computes dq inside the dK/dV kernel (5 matmuls per tile);
    False runs separate dq and dK/dV kernels (7). USP over a ring of more than one device runs both
    the other way (``parallel/usp.py`` says why); results are equal either way.
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None  # None = block_kv when block_kv is given, else tuned
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    backend: Backend = "auto"
    interpret_params: Any = None
    vmem_limit_bytes: int | None = None
    probs_dtype: ProbsDtype = "input"
    precision: Precision = "auto"
    segment_skipping: bool = True
    skip_empty_quadrants: bool = True
    #: bytes of scalar memory one kernel call's work list may take (longer lists run in pieces,
    #: ``splash/work_pieces.py``); None = from the chip generation (kernel backends) / unlimited (xla)
    smem_budget_bytes: int | None = None
    partial_tiles: PartialTiles = "auto"
    fused_backward: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_positive_multiple(name, getattr(self, name), NUM_LANES))
        if self.block_kv_compute is None and self.block_kv is not None:
            object.__setattr__(self, "block_kv_compute", self.block_kv)
        if self.block_kv_compute is not None:
            object.__setattr__(
                self, "block_kv_compute", check_positive_multiple("block_kv_compute", self.block_kv_compute, NUM_LANES)
            )
        if self.block_kv is not None and self.block_kv % self.block_kv_compute:
            raise ValueError(
                f"block_kv_compute={self.block_kv_compute} must divide block_kv={self.block_kv}"
            )
        check_choice("backend", self.backend, BACKENDS)
        if self.vmem_limit_bytes is not None:
            object.__setattr__(self, "vmem_limit_bytes", check_positive_int("vmem_limit_bytes", self.vmem_limit_bytes))
        check_choice("probs_dtype", self.probs_dtype, PROBS_DTYPES)
        check_choice("precision", self.precision, PRECISIONS)
        if not (self.interpret_params is None or self.interpret_params == GENERIC_INTERPRETER
                or isinstance(self.interpret_params, pltpu.InterpretParams)):
            raise TypeError(f"interpret_params must be None, {GENERIC_INTERPRETER!r} or a "
                            f"jax.experimental.pallas.tpu.InterpretParams, got {self.interpret_params!r}")
        check_choice("partial_tiles", self.partial_tiles, PARTIAL_TILES)
        for name in ("segment_skipping", "skip_empty_quadrants", "fused_backward"):  # np.bool_ too (was refused)
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.smem_budget_bytes is not None:
            object.__setattr__(self, "smem_budget_bytes",
                               check_positive_int("smem_budget_bytes", self.smem_budget_bytes))

    def matmul_dtype(self, input_dtype):
        """The dtype P and dS are rounded to before their matmuls (``probs_dtype``)."""
        return np.dtype(input_dtype) if self.probs_dtype == "input" else np.dtype(np.float32)

    def matmul_precision(self, input_dtype) -> lax.Precision | None:
        """The ``lax.Precision`` of the matmuls for inputs of ``input_dtype`` (``precision``);
        None = the platform default (one bfloat16 pass on TPU)."""
        if self.precision == "highest" or (self.precision == "auto" and np.dtype(input_dtype) == np.float32):
            return lax.Precision.HIGHEST
        return None

    @property
    def tuned(self) -> bool:
        """Whether some block is left to the tuned table (``splash/tuning.py``)."""
        return None in (self.block_q, self.block_kv, self.block_kv_compute, self.block_q_dkv, self.block_kv_dkv)

    def with_tuned_blocks(self, *, kv_len: int, head_dim: int | None = None, dtype=None,
                          device_kind: str | None = None, sparse: bool = False) -> "SplashConfig":
        """This config with every block left at None taken from the tuned table for the chip
        (``splash/tuning.py``; ``sparse``: a call with segment ids or a banded mask); explicit blocks
        are kept (an explicit ``block_kv_compute`` with a tuned ``block_kv``: the tuned block rounded
        down to a multiple of it)."""
        if not self.tuned:
            return self
        tuned = tuned_blocks(kv_len=kv_len, head_dim=head_dim, dtype=dtype, device_kind=device_kind,
                             sparse=sparse)._asdict()
        values = {name: getattr(self, name) if getattr(self, name) is not None else tuned[name] for name in tuned}
        compute = values["block_kv_compute"]
        if self.block_kv is None and values["block_kv"] % compute:  # an explicit compute slice tiles the tuned block
            values["block_kv"] = max(compute, values["block_kv"] // compute * compute)
        return dataclasses.replace(self, **values)

    @property
    def block_shape(self) -> tuple[int | None, int | None]:
        return (self.block_q, self.block_kv)

    @property
    def block_shape_dkv(self) -> tuple[int | None, int | None]:
        return (self.block_q_dkv, self.block_kv_dkv)
