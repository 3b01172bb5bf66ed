"""Walking traced programs: every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""


def equations(jaxpr, *, into_kernels: bool = True):
    """The equations of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) and of every jaxpr nested in them (scan,
    cond, custom VJP, shard_map bodies, ...), depth first. ``into_kernels=False``: a ``pallas_call`` is
    yielded but its kernel body is not entered (where ``pl.when`` is a cond)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        if not into_kernels and eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from equations(sub, into_kernels=into_kernels)
