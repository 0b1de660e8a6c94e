"""The compiled programs of :func:`lowbit.autoquant.score`: one per model structure, loss,
sites and candidates, each method's batch as one jitted function of the probe's state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowbit.flax.adapters import Probe
from lowbit.gemm import recipes as _recipes
from lowbit.gemm.recipes import Recipe

NONE = _recipes.get("none")


def scalar(out, where: str = "loss_fn"):
    """The loss of ``loss_fn``'s output: a scalar, or the first item of a (loss, aux) pair."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    shape = getattr(out, "shape", None)
    dtype = getattr(out, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        what = f"shape {shape} {dtype}" if shape is not None else type(out).__name__
        raise ValueError(
            f"score: {where} must return a scalar float loss (or a (loss, aux) pair), got {what}"
        )
    return out


def forward_only(r: Recipe) -> Recipe:
    """The forward of ``r`` (backward straight-through): what a site outputs under ``r``."""
    return Recipe(r.name, fwd=r.fwd, description=r.description, source=r.source)


def needs_key(r: Recipe) -> bool:
    return r.fwd.stochastic or bool(r.fwd.hadamard and r.fwd.random_signs)


# --------------------------------------------------------------------------------------------
# The methods' programs


def path_point(gemm, lhs, rhs, lq, rq, gate):
    """A site's output at ``gate`` on its path, ``y + gate (q - y)`` with ``y`` the float GEMM
    and ``q = lq @ rq`` the candidate's (``lq``, ``rq``: its forward operands), differentiated
    as the straight-through path: ``dL/dgate = <g, q - y>`` and one backward GEMM, ``dx = g
    ((1 - gate) W + gate rq)^T`` (the quantized activation passes the gradient straight
    through, as the recipes' own backward does), instead of one per branch."""

    @jax.custom_vjp
    def point(lhs, rhs, lq, rq, gate):
        y = gemm(lhs, rhs, NONE)
        return y + gate.astype(y.dtype) * (gemm(lq, rq, NONE).astype(y.dtype) - y)

    def fwd(lhs, rhs, lq, rq, gate):
        y = gemm(lhs, rhs, NONE)
        d = gemm(lq, rq, NONE).astype(y.dtype) - y
        return y + gate.astype(y.dtype) * d, (lhs, rhs, rq, gate, d)

    def bwd(res, g):
        lhs, rhs, rq, gate, d = res
        w = rhs.astype(jnp.float32)
        w = (w + gate * (rq - w)).astype(rhs.dtype)
        (dx,) = jax.vjp(lambda x: gemm(x, w, NONE), lhs)[1](g)
        dgate = jnp.sum(g.astype(jnp.float32) * d.astype(jnp.float32))
        return dx, jnp.zeros_like(rhs), jnp.zeros_like(lq), jnp.zeros_like(rq), dgate

    point.defvjp(fwd, bwd)
    return point(lhs, rhs, lq, rq, gate)


class Program:
    """The jitted programs of one ``score`` call (sites, candidates and model fixed)."""

    def __init__(self, run: Probe, loss_fn, output_fn, sites: list[str], recipes):
        self.run, self.loss_fn, self.output_fn = run, loss_fn, output_fn
        self.index = {p: i for i, p in enumerate(sites)}
        self.quant = [forward_only(r) for r in recipes[1:]]  # the candidates but "none"

    def qgemm(self, j: int, i: int, key, gemm, lhs, rhs):
        """Site ``i``'s GEMM under candidate ``j`` (1-based)."""
        r = self.quant[j - 1]
        k = None
        if needs_key(r):
            k = jax.random.fold_in(jax.random.fold_in(key, i), j)
        return gemm(lhs, rhs, r, k)

    def _float(self, gemm, lhs, rhs):
        return gemm(lhs, rhs, NONE)

    def operands(self, j: int, i: int, key, gemm, lhs, rhs):
        """Site ``i``'s operands as candidate ``j``'s forward GEMM multiplies them (float32)."""
        r = self.quant[j - 1]
        k = jax.random.fold_in(jax.random.fold_in(key, i), j) if needs_key(r) else None
        lq, rq = gemm.operands(lhs, rhs, r, k)
        return lq.astype(jnp.float32), rq.astype(jnp.float32)

    # isolated / kl: one site at one candidate per configuration ------------------------------

    def _selected(self, state, batch, sel, key, fn):
        def hook(site, gemm, lhs, rhs):
            i = self.index.get(site)
            if i is None:
                return self._float(gemm, lhs, rhs)
            branches = [lambda lhs, rhs: self._float(gemm, lhs, rhs)] + [
                functools.partial(self.qgemm, j, i, key, gemm)
                for j in range(1, len(self.quant) + 1)
            ]
            return jax.lax.switch(sel[i], branches, lhs, rhs)

        return self.run(fn, state, batch, hook)

    def loss_at(self, state, batch, key, sel):
        """The loss of one configuration (``sel[i]``: site ``i``'s candidate, 0 = float)."""
        return scalar(self._selected(state, batch, sel, key, self.loss_fn)).astype(jnp.float32)

    def logp_at(self, state, batch, key, sel):
        """The log-probabilities ``output_fn`` gives under one configuration."""
        out = self._selected(state, batch, sel, key, self.output_fn)
        return jax.nn.log_softmax(jnp.asarray(out, jnp.float32), axis=-1)

    @functools.cached_property
    def losses(self):
        """(state, batch, sels [n, sites], key) -> loss per configuration [n]."""

        @jax.jit
        def f(state, batch, sels, key):
            return jax.lax.map(functools.partial(self.loss_at, state, batch, key), sels)

        return f

    @functools.cached_property
    def kls(self):
        """(state, batch, sels [n, sites], key) -> mean KL(float || configuration) [n]."""

        @jax.jit
        def f(state, batch, sels, key):
            base = self.logp_at(state, batch, key, jnp.zeros_like(sels[0]))

            def kl(sel):
                lq = self.logp_at(state, batch, key, sel)
                return jnp.mean(jnp.sum(jnp.exp(base) * (base - lq), axis=-1))

            return jax.lax.map(kl, sels)

        return f

    # gradient: ModelOpt's score from one forward and backward -------------------------------

    @functools.cached_property
    def gradient(self):
        """(state, batch, key) -> sum((dL/dy * (Q_j(y) - y))^2) [sites, candidates - 1]."""
        prog = self

        def tap(i, key, gemm, lhs, rhs, sink):
            @jax.custom_vjp
            def f(lhs, sink):
                return prog._float(gemm, lhs, rhs)

            def fwd(lhs, sink):
                y, pull = jax.vjp(lambda x: prog._float(gemm, x, rhs), lhs)
                return y, (lhs, y, pull)

            def bwd(res, g):
                lhs, y, pull = res
                (dx,) = pull(g)
                g32, y32 = g.astype(jnp.float32), y.astype(jnp.float32)
                s = [
                    jnp.sum(
                        jnp.square(
                            g32 * (prog.qgemm(j, i, key, gemm, lhs, rhs).astype(jnp.float32) - y32)
                        )
                    )
                    for j in range(1, len(prog.quant) + 1)
                ]
                return dx, jnp.stack(s).astype(sink.dtype)

            f.defvjp(fwd, bwd)
            return f(lhs, sink)

        @jax.jit
        def f(state, batch, key):
            def loss(sink):
                def hook(site, gemm, lhs, rhs):
                    i = self.index.get(site)
                    if i is None:
                        return self._float(gemm, lhs, rhs)
                    return tap(i, key, gemm, lhs, rhs, sink[i])

                return scalar(self.run(self.loss_fn, state, batch, hook)).astype(jnp.float32)

            sink = jnp.zeros((len(self.index), len(self.quant)), jnp.float32)
            return jax.grad(loss)(sink)

        return f

    # shapley: credits along the joint path -------------------------------------------------

    @functools.cached_property
    def weights(self):
        """(state, batch, key, j) -> candidate ``j``'s quantized weight operand (``rq``) at
        every site, as its forward GEMM multiplies it: the path points take them as inputs, so
        that a weight is quantized once per call (once per batch for a candidate that draws
        random numbers) instead of once per point. The model's forward is traced for the
        sites' GEMMs only; XLA drops the rest."""

        @functools.partial(jax.jit, static_argnums=3)
        def f(state, batch, key, j):
            out = [None] * len(self.index)

            def hook(site, gemm, lhs, rhs):
                i = self.index.get(site)
                if i is not None:
                    out[i] = self.operands(j, i, key, gemm, lhs, rhs)[1]
                return self._float(gemm, lhs, rhs)

            self.run(self.loss_fn, state, batch, hook)
            return out

        return f

    def lhs_operand(self, j: int, i: int, key, gemm, lhs, rhs):
        """Site ``i``'s activation operand under candidate ``j`` (its weight's is unused)."""
        return self.operands(j, i, key, gemm, lhs, rhs)[0]

    @functools.cached_property
    def path(self):
        """(state, batch, key, t, j, rqs) -> dL/dgate [sites] at the path point where every
        site outputs ``y + t (Q_j(y) - y)`` (one program for every point and candidate);
        ``rqs``: :attr:`weights` of candidate ``j``."""

        @jax.jit
        def credits(state, batch, key, t, j, rqs):
            def loss(gates):
                def hook(site, gemm, lhs, rhs):
                    i = self.index.get(site)
                    if i is None:
                        return self._float(gemm, lhs, rhs)
                    branches = [
                        functools.partial(self.lhs_operand, jj, i, key, gemm)
                        for jj in range(1, len(self.quant) + 1)
                    ]
                    # values only: the path's gradient is path_point's own rule
                    lq = jax.lax.switch(j - 1, branches, *jax.lax.stop_gradient((lhs, rhs)))
                    rq = jax.lax.stop_gradient(rqs[i]).astype(jnp.float32)
                    return path_point(gemm, lhs, rhs, lq, rq, gates[i])

                return scalar(self.run(self.loss_fn, state, batch, hook)).astype(jnp.float32)

            return jax.grad(loss)(jnp.full((len(self.index),), t, jnp.float32))

        return credits


# Compiled programs of recent calls, so that scoring the same model again (more batches, another
# budget study, a benchmark) does not trace and compile again: (model structure, loss_fn,
# output_fn, sites, candidates) -> Program.
PROGRAMS: dict[tuple, Program] = {}
PROGRAMS_KEPT = 8


def program(run: Probe, loss_fn, output_fn, paths, recipes) -> Program:
    key = (run.adapter.name, run.structure, loss_fn, output_fn, tuple(paths), tuple(recipes))
    try:
        hash(key)
    except TypeError:  # an unhashable model structure or function: no reuse
        return Program(run, loss_fn, output_fn, paths, recipes)
    if key not in PROGRAMS:
        while len(PROGRAMS) >= PROGRAMS_KEPT:
            PROGRAMS.pop(next(iter(PROGRAMS)))
        PROGRAMS[key] = Program(run, loss_fn, output_fn, paths, recipes)
    return PROGRAMS[key]
