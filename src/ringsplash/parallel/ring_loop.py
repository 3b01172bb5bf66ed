"""The ring loop: a ``lax.scan`` over a mesh axis around the Splash kernels, the device side of
ring attention (the host plan and per-device schedules are in :mod:`ringsplash.parallel.ring_plan`,
the entry points and the factory in :mod:`ringsplash.parallel.ring`).

Queries stay put, sharded along the sequence on ``axis_name`` (N devices, token ``layout``
from :mod:`ringsplash.layouts`); K, V and the kv segment ids travel one hop per step.

Bookkeeping. K/V hop ``i -> i + 1`` (mod N) once per step, so at step ``t`` device ``i`` holds
kv shard ``(i - t) mod N``: its own at ``t = 0``, all N after N - 1 hops. Each step runs the
Splash forward on that (q shard ``i``, kv shard ``(i - t) mod N``) slice of one MaskInfo built
on the host for every shard pair, and merges the sink-free block result ``(o_t, lse_t)`` into
float32 state by online softmax in natural log:

    lse' = logaddexp(lse, lse_t),   o' = o * exp(lse - lse') + o_t * exp(lse_t - lse').

(``_softmax.merge`` computes the two weights as ``sigmoid(-/+ (lse_t - lse))``, which sum to 1
to float32 precision: with the rounded ``lse'`` every merge rescaled ``o`` by up to half an ulp
of the lse, and the float32 error grew with N at large logits; issue 39.)
Empty rows carry ``lse = MASKED_LSE`` (finite), whose weight ``exp(MASKED_LSE - lse')`` is 0,
so no step can produce NaN. A step whose shard pair has no non-empty block skips the kernel
and the merge (``lax.cond`` on ``num_active``), except on the ``interpret`` backend (see
``_RingStatic.skip_inactive``: the interpreter needs every device in every kernel). With segment ids (and
``SplashConfig.segment_skipping``), a pair is also skipped when no entry of its work list
survives the segment refinement, decided per step from the kv segment ids that travel with
K/V (``shares_segment``). Sinks join once, after the last step:
``lse_tot = logaddexp(lse, sink)``, ``out = o * exp(lse - lse_tot)``.

Backward (``custom_vjp``; residuals q, k, v, out, lse_tot). A second ring pass: K/V rotate as
in the forward, and float32 dK/dV accumulators rotate one step behind them. At step ``t``
device ``i`` receives the accumulator of kv shard ``(i - t)`` from ``i - 1`` (who added its
contribution at ``t - 1``) while it computes its own contribution for that shard; after the
last step one more hop brings each accumulator home (N hops in all). dq accumulates locally.
Around the last step (its incoming hop and the final one) dK and dV travel as one transfer
(``send_together``): two separate ones outside the scan were not always both hidden.
Every hop is issued before the step's kernel so the transfer overlaps it. Every step but the last
runs the fused backward kernel (dq accumulated inside the dK/dV kernel, as single-device Splash);
the last step runs the dK/dV kernel, then the dq kernel, so the final accumulator hop, which
depends only on the last dK/dV kernel, hides behind the last dq kernel (checked on compiled TPU
HLO in tests/test_ring_tpu_compile.py). No ``lax.cond`` is traced where every shard pair is active
and no segment test applies (e.g. causal + zigzag without segment ids: ``RingStatic.active_pair``).
A one-device ring (N = 1) is one Splash call: no cond, no merge, its output and gradients written in
the inputs' dtype.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from ringsplash._internal import softmax as _softmax
from ringsplash._internal.shard_map import axis_index, varying, vma
from ringsplash._internal.softmax import MASKED_LSE
from ringsplash.parallel.ring_blocks import block_backward, block_forward, shares_segment
from ringsplash.parallel.ring_plan import RingPlan
from ringsplash.splash.attention import KvExchange
from ringsplash.splash.config import SplashConfig

__all__ = ["RingStatic", "run_ring"]


# ----------------------------------------------------------------------------------------
# the ring


@dataclasses.dataclass(frozen=True)
class RingStatic:
    """Non-differentiable settings of one ring call (hashable; the plan by identity, as
    ``ring_plan`` caches it): the plan, N devices on ``axis``, the kernels' scale / soft-cap /
    config, the scan's ``unroll``, the sinks' varying axes, and whether the call also returns
    ``max_logits [heads]`` (the running max over the steps' kernels, then one ``pmax`` over the
    axis; no gradient)."""

    plan: RingPlan
    n: int
    axis: object
    scale: float
    logit_soft_cap: float | None
    config: SplashConfig
    unroll: int | bool
    sinks_vma: frozenset = frozenset()
    max_logits: bool = False
    kv_exchange: KvExchange | None = None  # maps the caller's k / v to the ring's (USP: Ulysses' all-to-all)

    def send(self, x):
        """``x`` one hop along the ring: device i sends to i + 1."""
        hop = [(i, (i + 1) % self.n) for i in range(self.n)]
        return lax.ppermute(x, axis_name=self.axis, perm=hop)

    @property
    def kw(self) -> dict:
        return {"scale": self.scale, "cap": self.logit_soft_cap, "config": self.config}

    @property
    def split_last(self) -> bool:
        # Kernel backends compute dq and dK/dV in separate kernels: two conds on the last step
        # cost nothing once XLA drops each branch's unused kernel (the fused xla backend would
        # run twice).
        return self.config.backend != "xla"

    @property
    def skip_inactive(self) -> bool:
        # Skipping inactive shard pairs with lax.cond saves whole kernels on TPU (and with the xla
        # backend). The Pallas TPU interpreter cannot skip: every interpreted pallas_call waits on a
        # process-wide threading.Barrier of all devices before its first grid step (it models
        # remote DMAs, and a kernel without collective_id gets a global barrier) and on a second
        # one when it frees the shared memory at its end; no InterpretParams removes them. A device
        # that skips a kernel its peers run leaves them blocked there (N = 2: forever; N >= 4: until
        # XLA's collective-permute rendezvous times out and aborts), and mismatched kernel counts
        # would pair different kernels across devices. So there every device runs every step's
        # kernels; an inactive pair's work list is empty, giving o = 0, lse = MASKED_LSE (merge is
        # exact: weight 0) and zero dq / dK / dV.
        return self.config.backend != "interpret"

    @property
    def all_active(self) -> bool:
        """Every shard pair active: then, without segment ids, XLA folds every cond away."""
        return bool(np.all(self.plan.active))

    def active_pair(self, me, src, q_seg, kv_seg, sched):
        """The traced predicate of a ``lax.cond`` that skips the pair (``me``, ``src``)'s kernels where
        it contributes nothing (inactive under the mask, or no shared segment: ``shares_segment``), or
        None where no cond is wanted: on the interpreter (see ``skip_inactive``), where every pair is
        active and no segment test applies, and on a ring of one device, whose one pair is its own (as
        in single-device Splash its kernels run unconditionally, their work lists refined by the ids;
        a cond around them, decided by a second pass over the lists, only costs there: 0.96x Splash on
        16 packed documents at 8K fwd+bwd on a v5e chip, 2026-12-07)."""
        if not self.skip_inactive:
            return None
        shares = True if self.n == 1 else shares_segment(self.plan, me, src, q_seg, kv_seg, self.config, sched)
        if self.all_active and shares is True:
            return None
        return jnp.asarray(self.plan.active)[me, src] & shares

    def visiting(self, me, t):
        """The kv shard held by device ``me`` at step ``t``."""
        return (me - t) % self.n


def _ring_forward(st: RingStatic, q, k, v, q_seg, kv_seg, sinks, sched):
    """``(out, residuals)``; ``out`` is ``(out, max_logits)`` with ``st.max_logits``."""
    plan, n, axis_name, max_logits = st.plan, st.n, st.axis, st.max_logits
    if st.kv_exchange is not None:  # the exchanged K / V are the residuals (no re-exchange backward)
        k, v = st.kv_exchange.gather(k), st.kv_exchange.gather(v)
    me = axis_index(axis_name)

    def step(carry, t, *, last, first=False):
        k_t, v_t, seg_t, o, lse, mx = carry
        nxt = (k_t, v_t, seg_t) if last else st.send((k_t, v_t, seg_t))  # issued before compute
        src = st.visiting(me, t)

        def compute(o, lse, mx):
            o_t, lse_t, *mx_t = block_forward(q, k_t, v_t, plan, me, src, q_seg, seg_t, **st.kw,
                                               max_logits=max_logits, sched=sched, out_dtype=o.dtype)
            # a one-step ring's state is empty: the kernel's result is the state (no merge pass)
            o, lse = (o_t, lse_t) if first else _softmax.merge(o, lse, o_t, lse_t)  # natural log throughout
            return o, lse, (jnp.maximum(mx, mx_t[0]) if max_logits else mx)

        pred = st.active_pair(me, src, q_seg, seg_t, sched)
        if pred is None:
            o, lse, mx = compute(o, lse, mx)
        else:
            o, lse, mx = lax.cond(pred, compute, lambda o, lse, mx: (o, lse, mx), o, lse, mx)
        return (*nxt, o, lse, mx), None

    # A one-step ring merges nothing: its kernel writes q's dtype and its (out, lse) are the
    # result, as in single-device Splash; otherwise the state is float32 (the partial outputs
    # are merged unrounded).
    o_dtype = q.dtype if n == 1 else jnp.float32
    o = varying(jnp.zeros((*q.shape[:2], v.shape[-1]), o_dtype), axis_name)  # v's head size
    lse = varying(jnp.full(q.shape[:2], MASKED_LSE, jnp.float32), axis_name)
    mx = varying(jnp.full(q.shape[:1], -jnp.inf, jnp.float32), axis_name)  # max logits (max_logits)
    carry = (k, v, kv_seg, o, lse, mx)
    # Steps 0 .. N-2 send K/V on; the last step only computes. Step 0 stays in the scan (peeled,
    # to skip its merge, it left the loop two steps at N = 4, and XLA then scheduled USP's forward
    # K/V transfers after the kernels on v5p: tests/test_parallel_tpu_compile.py).
    if n > 1:
        carry, _ = lax.scan(functools.partial(step, last=False), carry, jnp.arange(n - 1), unroll=st.unroll)
    (_, _, _, o, lse, mx), _ = step(carry, n - 1, last=True, first=n == 1)
    lse = jnp.maximum(lse, MASKED_LSE)  # logaddexp of empty states stays MASKED_LSE
    o, lse = _softmax.fold_sinks(o, lse, sinks)  # the sink joins each row's denominator once
    # named for remat policies (model.attention.ATTENTION_OUT / ATTENTION_LSE): saving them
    # lets the backward pass skip re-running this forward ring
    out = checkpoint_name(o.astype(q.dtype), "attention_out")
    res = (q, k, v, out, checkpoint_name(lse, "attention_lse"))
    if max_logits:  # every device's running max: one pmax per call
        return (out, lax.stop_gradient(lax.pmax(mx, axis_name))), res
    return out, res


def _ring_backward(st: RingStatic, res, q_seg, kv_seg, sinks, sched, d_out):
    """``(dq, dk, dv, d_sinks)``: a second ring pass (see the module docstring)."""
    plan, n, axis_name = st.plan, st.n, st.axis
    q, k, v, out, lse = res
    me = axis_index(axis_name)
    d_out = d_out.astype(q.dtype)
    delta = _softmax.delta(d_out, out)
    zeros = lambda x: varying(jnp.zeros(x.shape, jnp.float32), axis_name)

    def send_together(dk, dv):
        """dK and dV as one transfer, for the two hops around the last step: outside the
        scan, XLA's scheduler hides one transfer behind the last dq kernel but (as measured
        on the compiled USP program) not always two; inside the scan it hides both."""
        both = st.send(jnp.concatenate([dk, dv], axis=-1))
        return both[..., : dk.shape[-1]], both[..., dk.shape[-1]:]

    def contribution(k_t, v_t, seg_t, src, dq, dk, dv, *, parts=("dq", "dkv"), first=False):
        """(dq, dK, dV) plus this step's contributions for kv shard `src`; unchanged for an
        empty pair (computed, adding zeros, on the interpret backend). ``parts`` keeps only
        the sums that are needed (only their kernel runs). Where no pair is skipped the
        kernels' pieces are added into the accumulators as they are produced (no
        whole-shard gradient temporaries); under a cond the received accumulators are added
        outside it instead, so their transfer only has to land after the kernel. ``first``: the
        accumulators are still zero, so the kernels' gradients become them (no adding pass)."""
        keep = lambda new, old: tuple(n if p in parts else o for n, o, p in zip(new, old, ("dq", "dkv", "dkv")))

        def compute(dq, dk, dv):
            new = block_backward(q, k_t, v_t, d_out, lse, delta, plan, me, src, q_seg, seg_t, **st.kw,
                                  sched=sched, accumulate=(dq, dk, dv), parts=parts)
            return keep(new, (dq, dk, dv))

        pred = st.active_pair(me, src, q_seg, seg_t, sched)
        if first and parts == ("dq", "dkv"):
            # a one-step ring's gradients are final: written in the inputs' dtype, as single-device
            # Splash writes them (unless a K/V exchange sums them first: float32)
            sums = st.kv_exchange is not None and st.kv_exchange.sums_partials
            dtype = k.dtype if n == 1 and not sums else jnp.float32
            fresh = lambda: block_backward(q, k_t, v_t, d_out, lse, delta, plan, me, src, q_seg, seg_t, **st.kw,
                                           sched=sched, grad_dtype=dtype)
            if pred is None:
                return fresh()
            none = lambda: tuple(varying(jnp.zeros(x.shape, dtype), axis_name) for x in (q, k_t, v_t))
            return lax.cond(pred, fresh, none)
        if pred is None:  # accumulate in place
            return compute(dq, dk, dv)
        zero_kv = lambda dq: (dq, zeros(k_t), zeros(v_t))
        dq, dk_t, dv_t = lax.cond(pred, lambda dq: compute(*zero_kv(dq)), zero_kv, dq)
        return (dq, dk + dk_t, dv + dv_t) if "dkv" in parts else (dq, dk, dv)

    def step(carry, t, *, last):
        k_t, v_t, seg_t, dq, dk, dv = carry
        nxt = (k_t, v_t, seg_t) if last else st.send((k_t, v_t, seg_t))
        # now the accumulators of kv shard (me - t), from me - 1 (the last step's as one transfer)
        dk, dv = send_together(dk, dv) if last else st.send((dk, dv))
        src = st.visiting(me, t)
        if last and st.split_last:
            # the final hop needs only dK/dV: a separate cond lets the dq kernel hide it
            _, dk, dv = contribution(k_t, v_t, seg_t, src, dq, dk, dv, parts=("dkv",))
            dq, _, _ = contribution(k_t, v_t, seg_t, src, dq, dk, dv, parts=("dq",))
        else:
            dq, dk, dv = contribution(k_t, v_t, seg_t, src, dq, dk, dv)
        return (*nxt, dq, dk, dv), None

    # step 0: own kv shard; its accumulators start here
    nxt = st.send((k, v, kv_seg)) if n > 1 else (k, v, kv_seg)
    dq, dk, dv = contribution(k, v, kv_seg, me, zeros(q), zeros(k), zeros(v), first=True)
    if n > 1:
        carry = (*nxt, dq, dk, dv)
        if n > 2:
            carry, _ = lax.scan(functools.partial(step, last=False), carry, jnp.arange(1, n - 1), unroll=st.unroll)
        (_, _, _, dq, dk, dv), _ = step(carry, n - 1, last=True)
        dk, dv = send_together(dk, dv)  # N-th hop: every accumulator is home
    d_sinks = None
    if sinks is not None:  # d sink_h = -sum_i exp(sink_h - lse_i) delta_i, over all shards
        local = _softmax.sinks_grad(sinks, lse, delta)
        # Replicated sinks: with vma checking their cotangent must be replicated too, so sum
        # it here; without it (vma empty everywhere) shard_map's transpose sums it for us.
        if axis_name in vma(local) - st.sinks_vma:
            local = lax.psum(local, axis_name)
        d_sinks = local.astype(sinks.dtype)
    if st.kv_exchange is not None:  # back to the caller's k / v, summed in float32, one cast
        return dq.astype(q.dtype), st.kv_exchange.reduce(dk, k.dtype), st.kv_exchange.reduce(dv, v.dtype), d_sinks
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def run_ring(st: RingStatic, q, k, v, q_seg, kv_seg, sinks, sched):
    """The ring of (q, k, v, q_seg, kv_seg, sinks) for the statics ``st`` (``(out, max_logits)``
    with ``st.max_logits``)."""
    return _ring_forward(st, q, k, v, q_seg, kv_seg, sinks, sched)[0]


def _ring_fwd(st: RingStatic, q, k, v, q_seg, kv_seg, sinks, sched):
    out, res = _ring_forward(st, q, k, v, q_seg, kv_seg, sinks, sched)
    return out, (res, q_seg, kv_seg, sinks, sched)


def _ring_bwd(st: RingStatic, saved, d_out):
    res, q_seg, kv_seg, sinks, sched = saved
    if st.max_logits:  # the max logits carry no gradient: their cotangent is dropped
        d_out = d_out[0]
    dq, dk, dv, d_sinks = _ring_backward(st, res, q_seg, kv_seg, sinks, sched, d_out)
    return dq, dk, dv, None, None, d_sinks, None


run_ring.defvjp(_ring_fwd, _ring_bwd)
