"""Types shared by signatures: the array aliases (jaxtyping; checked at runtime in tests only) and the
one result type of every attention entry point, and the deprecated tuple forms.

An entry point returns ``out`` alone, or, when the caller asks for more (``with_lse=True``,
``with_max_logits=True``), an :class:`AttentionOutput` whose fields not asked for are None.
The flags of the previous release (``return_residuals``, ``return_max_logits``) still return
their positional tuples, ``(out, lse)``, ``(out, max_logits)`` or ``(out, lse, max_logits)``,
with a ``DeprecationWarning``; they go in the next release.
"""

import warnings
from typing import NamedTuple

from jaxtyping import Array, Bool, Float, Int, Shaped

__all__ = ["Array", "AttentionOutput", "Bool", "Float", "Int", "Outputs", "Shaped", "outputs"]


class AttentionOutput(NamedTuple):
    """What an attention call returns when asked for more than ``out``.

    Fields:
        out: the attention output ``[heads, q_len, dv]`` in q's dtype.
        lse: float32 ``[heads, q_len]`` log-sum-exp of each row (natural log, sinks included),
            differentiable; None unless asked for (``with_lse=True``).
        max_logits: float32 ``[heads]`` largest ``scale * q.k`` each head attends (before the
            soft-cap, without sinks; ``-inf`` where a head attends nothing), no gradient; None
            unless asked for (``with_max_logits=True``).
    """

    out: object
    lse: object = None
    max_logits: object = None


class Outputs(NamedTuple):
    """What one call computes and how it returns it (from :func:`outputs`)."""

    lse: bool
    max_logits: bool
    legacy: bool  # a deprecated flag was given: return the old positional tuple

    def package(self, out, lse=None, max_logits=None):
        """``out``, an :class:`AttentionOutput`, or (``legacy``) the old tuple."""
        if self.legacy:
            return (out, *((lse,) if self.lse else ()), *((max_logits,) if self.max_logits else ()))
        if not (self.lse or self.max_logits):
            return out
        return AttentionOutput(out, lse if self.lse else None, max_logits if self.max_logits else None)


def _flag(what: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def outputs(what: str, *, with_lse: bool = False, with_max_logits: bool = False, return_residuals: bool = False,
            return_max_logits: bool = False, lse_supported: bool = True) -> Outputs:
    """Resolve an entry point's result flags; warns (``DeprecationWarning``, at the caller of
    ``what``) for ``return_residuals`` / ``return_max_logits``.

    Raises:
        TypeError: a flag that is not a bool.
        ValueError: new and deprecated flags mixed, or ``with_lse`` where ``what`` has no lse.
    """
    new = (_flag(what, "with_lse", with_lse), _flag(what, "with_max_logits", with_max_logits))
    old = (_flag(what, "return_residuals", return_residuals), _flag(what, "return_max_logits", return_max_logits))
    if any(new) and any(old):
        raise ValueError(f"{what}: pass with_lse / with_max_logits (an AttentionOutput) or the deprecated "
                         f"return_residuals / return_max_logits (a tuple), not both; got with_lse={with_lse}, "
                         f"with_max_logits={with_max_logits}, return_residuals={return_residuals}, "
                         f"return_max_logits={return_max_logits}")
    if (new[0] or old[0]) and not lse_supported:
        raise ValueError(f"{what} does not return lse: expected with_lse=False, got with_lse=True")
    if any(old):
        given = " and ".join(n for n, v in zip(("return_residuals=True", "return_max_logits=True"), old) if v)
        warnings.warn(f"{what}({given}) is deprecated and goes in the next release: pass with_lse=True / "
                      f"with_max_logits=True and read the fields of the ringsplash.AttentionOutput it returns",
                      DeprecationWarning, stacklevel=3)
        return Outputs(old[0], old[1], True)
    return Outputs(new[0], new[1], False)
