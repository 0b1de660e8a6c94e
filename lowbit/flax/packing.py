"""Sites, describe(), and packing trained weights into QArrays (and back)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

import lowbit as lb
from lowbit.flax import _core
from lowbit.flax._core import Layout, Rules, Site
from lowbit.gemm.implementation import resolve, validate


def sites(model, rules, *args, implementation: str | None = None, **kwargs) -> list[Site]:
    """The quantizable GEMMs of ``model`` and the recipe ``rules`` give each (None: no rule,
    the module stays as it is). A Linen model is traced abstractly (``jax.eval_shape``) on
    example inputs ``*args`` (arrays or ``jax.ShapeDtypeStruct``); an NNX model needs none.
    ``implementation``: recorded on the quantized sites (``Site.implementation``), as
    ``quantize(model, rules, implementation=...)`` would run them.

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> model = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
    >>> [(s.path, s.kind, s.recipe.name, s.layout) for s in lbf.sites(model, [(".*", "nvfp4")])]
    [('', 'dot_general', 'nvfp4', Layout(axis=0, other_axis=1))]
    """
    if _core.framework(model) == "nnx":
        from lowbit.flax import nnx as _nnx

        if args or kwargs:
            raise TypeError("an NNX model needs no example inputs")
        return _nnx.sites(model, rules, implementation=implementation)
    from lowbit.flax import linen as _linen

    return _linen.sites(model, rules, *args, implementation=implementation, **kwargs)[0]


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
        lambda x: _dequantize(x, dtype) if _core.is_qarray(x) else x,
        tree,
        is_leaf=_core.is_qarray,
    )


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q, dtype):
    return lb.dequantize(q, dtype)


def _split_variables(tree):
    """Linen ``{"params": {...}}`` -> (inner, rewrap)."""
    if isinstance(tree, dict) and set(tree) == {"params"}:
        return tree["params"], lambda inner: {**tree, "params": inner}
    return tree, lambda inner: inner


def pack(params, rules, *, sites: list[Site] | dict[str, Layout] | None = None):
    """Quantize trained float weights into packed :class:`lowbit.QArray` s, per ``rules``.

    Each weight that a rule's recipe quantizes in its forward GEMM is quantized exactly as
    that GEMM quantizes it (format, 1-D blocks or 2-D tiles along the contraction axis, scale
    mode): a packed model's outputs equal the fake-quantized model's bit for bit. Other
    leaves pass through; weights of recipes whose forward keeps them in high precision too.

    Args:
      params: an NNX model (its ``nnx.Param`` state is packed), an NNX ``State``, or a Linen
        params dict (or ``{"params": ...}``).
      rules: ``[(path_regex, recipe), ...]`` as for :func:`lowbit.flax.quantize`.
      sites: where each weight's contraction axis is: the output of :func:`sites` (needed for
        Linen weights of rank > 2: ``DenseGeneral``, ``Einsum``), or ``{kernel_path: Layout}``.
        Without it, a rank-2 ``kernel`` is ``[in, out]`` (``Dense``, ``Linear``).

    >>> import jax.numpy as jnp, lowbit.flax as lbf
    >>> from flax import nnx
    >>> model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    >>> packed = lbf.pack(model, [(".*", "qat_mxfp4")])
    >>> q = packed["kernel"].get_value()
    >>> q.format_name, q.nbytes, 64 * 32 * 4
    ('mxfp4', 1088, 8192)
    """
    rules = Rules.of(rules)
    layouts: dict[str, Layout | None] | None = None
    try:
        from flax import nnx

        if isinstance(params, nnx.Module):
            if sites is None:
                sites = _nnx_sites(params, rules)
            params = nnx.state(params, nnx.Param)
    except ImportError:  # pragma: no cover
        pass
    if sites is not None:
        layouts = (
            dict(sites)
            if isinstance(sites, dict)
            else {s.kernel: s.layout for s in sites if s.kernel is not None}
        )
    inner, rewrap = _split_variables(params)

    def one(keypath, leaf):
        names = _core.keypath_str(keypath)
        if not names or names[-1] != "kernel" or _core.is_qarray(leaf):
            return leaf
        kpath = _core.path_str(names)
        mpath = _core.path_str(names[:-1])
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

    out = jax.tree_util.tree_map_with_path(one, inner, is_leaf=_core.is_qarray)
    return rewrap(out)


def _nnx_sites(model, rules):
    from lowbit.flax import nnx as _nnx

    return _nnx.sites(model, rules)


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
    implementation: str | None = None  # of a quantized site (None: the backend's best)


def weight_bits(recipe: lb.Recipe | None, dtype) -> float:
    """Bits per weight element a recipe stores (its forward weight spec), else the dtype's."""
    if recipe is not None and not recipe.is_identity and recipe.fwd.rhs is not None:
        return float(recipe.fwd.rhs.bits_per_element)
    return 8.0 * np.dtype(dtype).itemsize


def describe(
    model, rules, *args, implementation: str | None = None, print_fn=print, **kwargs
) -> list[Row]:
    """Print which module gets which recipe and the resulting bits per weight; return the
    rows (the last one: the model total over all parameters).

    ``implementation``: what the quantized GEMMs would run (as for
    :func:`lowbit.flax.quantize`), shown per quantized site (``"auto"`` for None).

    Bits per weight come from the recipe's forward weight spec (e.g. MXFP4: 4 bits + one
    8-bit scale per 32 = 4.25; NVFP4 with 16x16 tiles: 4 + 8/256); unquantized parameters
    count their dtype's bits. Linen models are traced on example inputs ``*args``.

    >>> import lowbit.flax as lbf
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    >>> rows = lbf.describe(model, [("layers/0", "qat_mxfp4")], print_fn=None)
    >>> [(r.path, r.recipe, r.bits_per_param) for r in rows[:2]]
    [('layers/0', 'qat_mxfp4', 4.25), ('layers/1', '-', 32.0)]
    >>> rows[-1].params
    4680
    """
    rules = Rules.of(rules)
    validate(implementation)
    fw = _core.framework(model)
    if fw == "nnx":
        from flax import nnx

        site_list = sites(model, rules, *args, implementation=implementation, **kwargs)
        params = nnx.state(model, nnx.Param)
    else:
        from lowbit.flax import linen as _linen

        site_list, params = _linen.sites(
            model, rules, *args, implementation=implementation, **kwargs
        )
    rows = []
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
        rows.append(Row(s.path, s.module, s.kind, r.name if r else "-", s.shape, n, bits, impl))
    total_n, total_bits = 0, 0.0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _core.path_str(_core.keypath_str(keypath))
        n = math.prod(np.shape(leaf))
        total_n += n
        total_bits += n * quantized.get(name, 8.0 * np.dtype(leaf.dtype).itemsize)
    rows.append(Row("total", "", "", "", None, total_n, total_bits / total_n if total_n else None))
    if print_fn is not None:
        print_fn(format_rows(rows, rules, site_list))
    return rows


def format_rows(
    rows: list[Row], rules: Rules | None = None, site_list: list[Site] | None = None
) -> str:
    head = ("path", "module", "kind", "recipe", "impl", "weight", "params", "bits/param")
    table = [head]
    for r in rows:
        impl = r.recipe if r.recipe in ("-", "") else (r.implementation or "auto")
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
    if any(row[4] == "auto" for row in table[1:]):
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
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=_core.is_qarray):
        if _core.is_qarray(leaf):
            total += leaf.nbytes
        else:
            total += int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
    return total
