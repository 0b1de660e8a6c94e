"""Sites, describe(), and packing trained weights into QArrays (and back)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

import lowbit as lb
from lowbit.bits import bits_per_element, leaf_nbytes
from lowbit.flax import _core
from lowbit.flax._core import Layout, Rules, Site
from lowbit.gemm.implementation import Implementation, resolve
from lowbit.io.tree import is_qarray, keypath_str, path_str

# --------------------------------------------------------------------------------------------
# pack / unpack


def unpack(tree, dtype=None):
    """Dequantize every :class:`lowbit.QArray` in ``tree`` (to its original dtype, or
    ``dtype``); other leaves pass through. Jittable: inside ``jax.jit`` the dequantization
    runs in XLA, next to the GEMMs that use the weights.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> tree = lbf.pack({"kernel": jnp.ones((32, 4)), "bias": jnp.zeros(4)}, [(".*", "qat_mxfp4")])
    >>> type(tree["kernel"]).__name__, lbf.unpack(tree)["kernel"].shape
    ('QArray', (32, 4))
    """
    return jax.tree.map(
        lambda x: _dequantize(x, dtype) if is_qarray(x) else x,
        tree,
        is_leaf=is_qarray,
    )


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q, dtype):
    if _core.is_stacked(q):  # a grouped GEMM's expert stack: one tensor per expert
        return jax.vmap(lambda qg: lb.dequantize(qg, dtype))(q)
    return lb.dequantize(q, dtype)


def _split_variables(tree):
    """Linen ``{"params": {...}}`` -> (inner, rewrap)."""
    if isinstance(tree, dict) and set(tree) == {"params"}:
        return tree["params"], lambda inner: {**tree, "params": inner}
    return tree, lambda inner: inner


def layouts_of(sites: list[Site] | dict[str, Layout] | None) -> dict[str, Layout | None] | None:
    """``{kernel path: Layout}`` of :func:`lowbit.flax.sites`' output (a dict passes)."""
    if sites is None or isinstance(sites, dict):
        return None if sites is None else dict(sites)
    return {s.kernel: s.layout for s in sites if s.kernel is not None}


def pack_params(params, rules: Rules, layouts: dict[str, Layout | None] | None):
    """:func:`lowbit.flax.pack` of a parameter tree (an NNX ``State``, a Linen params dict or
    ``{"params": ...}``) given each kernel's layout (None: rank-2 kernels are ``[in, out]``)."""
    inner, rewrap = _split_variables(params)

    def one(keypath, leaf):
        names = keypath_str(keypath)
        if not names or names[-1] != "kernel" or is_qarray(leaf):
            return leaf
        kpath = path_str(names)
        mpath = path_str(names[:-1])
        if layouts is not None and kpath not in layouts:
            return leaf  # not a GEMM weight (a convolution, an embedding, ...)
        recipe = rules.active(mpath)
        if recipe is None:
            return leaf
        spec = _core.weight_spec(recipe, mpath)
        if spec is None:
            return leaf
        if layouts is not None:
            layout = layouts[kpath]
        elif np.ndim(leaf) == 2:
            layout = Layout(0, 1)
        else:
            layout = None
        if layout is None:
            raise ValueError(
                f"pack: cannot tell the contraction axis of {kpath!r} (shape "
                f"{tuple(np.shape(leaf))}); pass sites=lowbit.flax.sites(model, rules, "
                "*example_inputs)"
            )
        return _core.pack_weight(leaf, spec, layout)

    out = jax.tree_util.tree_map_with_path(one, inner, is_leaf=is_qarray)
    return rewrap(out)


# --------------------------------------------------------------------------------------------
# describe


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of :func:`describe`: a site, or the model total (``path == "total"``)."""

    path: str
    module: str
    kind: str
    recipe: str
    shape: tuple[int, ...] | None
    params: int
    bits_per_param: float | None
    implementation: Implementation | None = None  # of a quantized site (None: not one)


def weight_bits(recipe: lb.Recipe | None, dtype) -> float:
    """Bits per weight element a recipe stores (its forward weight spec), else the dtype's:
    the ``describe`` convention of :func:`lowbit.bits.bits_per_element` (float = its dtype,
    no tensor scale)."""
    spec = recipe.fwd.rhs if recipe is not None and not recipe.is_identity else None
    return bits_per_element(spec, float_bits=8.0 * np.dtype(dtype).itemsize)


def rows(site_list: list[Site], params) -> list[Row]:
    """:func:`lowbit.flax.describe`'s rows of ``site_list`` over the parameter tree
    ``params`` (the last row: the model total)."""
    out = []
    quantized: dict[str, float] = {}
    for s in site_list:
        r = s.recipe if s.recipe is not None and not s.recipe.is_identity else None
        if s.kernel is not None:
            n = math.prod(s.shape)
            bits = weight_bits(r, s.dtype)
            if r is not None:
                quantized[s.kernel] = bits
        else:
            n, bits = 0, None
        impl = s.implementation if r is not None else None
        out.append(Row(s.path, s.module, s.kind, r.name if r else "-", s.shape, n, bits, impl))
    total_n, total_bits = 0, 0.0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(keypath_str(keypath))
        n = math.prod(np.shape(leaf))
        total_n += n
        total_bits += n * quantized.get(name, 8.0 * np.dtype(leaf.dtype).itemsize)
    out.append(Row("total", "", "", "", None, total_n, total_bits / total_n if total_n else None))
    return out


def _impl_cell(impl: Implementation | None) -> str:
    """What a quantized site runs: the label, ``(auto)`` when the backend chose it."""
    if impl is None:
        return "auto"
    return f"{impl.label} (auto)" if impl.requested is None else impl.label


def format_rows(
    rows: list[Row], rules: Rules | None = None, site_list: list[Site] | None = None
) -> str:
    head = ("path", "module", "kind", "recipe", "impl", "weight", "params", "bits/param")
    table = [head]
    for r in rows:
        impl = r.recipe if r.recipe in ("-", "") else _impl_cell(r.implementation)
        table.append(
            (
                r.path or "(root)",
                r.module,
                r.kind,
                r.recipe,
                impl,
                "x".join(map(str, r.shape)) if r.shape else "-",
                f"{r.params:,}" if r.params else "-",
                f"{r.bits_per_param:.4g}" if r.bits_per_param is not None else "-",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i >= 6 else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    if any(row[4].endswith("(auto)") for row in table[1:]):
        lines.append(
            f"impl auto: the best available for the backend "
            f"({resolve(None).label!r} on {jax.default_backend()})"
        )
    if rules is not None and site_list is not None:
        unused = [
            r.pattern for r in rules.rules if not any(r.regex.fullmatch(s.path) for s in site_list)
        ]
        if unused:
            lines.append(f"rules that match no site: {unused}")
    return "\n".join(lines)


def packed_nbytes(tree: Any) -> int:
    """Bytes a (packed) tree holds: QArray codes and scales, other leaves in their dtype.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> params = {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}
    >>> lbf.packed_nbytes(params), lbf.packed_nbytes(lbf.pack(params, [(".*", "qat_mxfp4")]))
    (8320, 1216)
    """
    return sum(leaf_nbytes(x) for x in jax.tree.leaves(tree, is_leaf=is_qarray))
