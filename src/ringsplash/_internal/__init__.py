"""Private helpers shared by every layer (not public API; imported by module, never re-exported):

* argument checks: ``checks`` (the one validation path of every attention entry point), ``scalar_checks``
  (ints, floats, choices, numpy / JAX scalars);
* types and numerics: ``types`` (jaxtyping aliases, the attention output record), ``softmax`` (the online-softmax
  algebra: merge, sinks, delta, shared by every path);
* runtime: ``caches`` (the one bounded cache of host work and ``clear_caches``), ``shard_map`` (varying-axis
  helpers), ``optional`` (optional packages: a missing one is one line naming its extra).
"""
