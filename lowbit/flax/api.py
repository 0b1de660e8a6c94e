"""The entry points of :mod:`lowbit.flax`: each resolves ``implementation=`` and picks the
model's adapter (:mod:`lowbit.flax.adapters`) once, and passes both down."""

from __future__ import annotations

from lowbit.flax._core import Layout, Rules, Site
from lowbit.flax.adapters import adapter_for
from lowbit.flax.packing import Row, format_rows, layouts_of, pack_params, rows
from lowbit.gemm.implementation import Implementation, resolve

__all__ = ["quantize", "sites", "describe", "pack"]


def quantize(
    model,
    rules,
    *,
    rngs=None,
    packed: bool = False,
    method: str = "__call__",
    implementation: str | Implementation | None = None,
    observe: bool = False,
):
    """Apply ``rules`` to a Linen module or an NNX model whose code knows nothing of lowbit.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      rules: ``[(path_regex, recipe), ...]``; recipe: a name (``lb.recipes.names()``) or a
        :class:`lowbit.Recipe`. See the module docstring for paths and matching.
      rngs: NNX only: an ``nnx.Rngs`` with a ``"quant"`` stream, needed when a matched recipe
        needs keys. (Linen modules draw from ``apply(..., rngs={"quant": key})``.)
      packed: serve packed weights (:func:`pack`): weights enter their GEMMs as packed,
        without being quantized again. Linen: the returned module's ``apply`` takes the packed
        params directly. NNX: use :class:`lowbit.flax.nnx.PackedModel` instead.
      method: Linen only: the method ``__call__`` of the returned module runs.
      implementation: what every quantized GEMM runs, passed on to each
        :func:`lowbit.dot_general` / :func:`lowbit.einsum` call: ``"xla"`` (the emulation,
        the reference), ``"pallas"`` (the Pallas kernels when lowered for CUDA, the emulation
        elsewhere) or None (the best available for the backend).
      observe: the sites the rules quantize compute in float instead, with ops that know
        their site path, so that :func:`observing` and :func:`substituting` hooks reach them
        (calibration, sensitivity scores); the recipes themselves are not applied.

    Returns:
      Linen: a :class:`lowbit.flax.linen.Quantized` module with the same parameter tree
      (``init`` / ``apply`` as usual). NNX: a new model (``nnx.clone``) whose matched modules
      hold quantized ops; ``model`` itself is unchanged.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, lowbit.flax as lbf
    >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
    >>> x = jnp.ones((4, 32))
    >>> variables = jax.jit(model.init)(jax.random.key(0), x)
    >>> qmodel = lbf.quantize(model, [(r"layers_0", "nvfp4")])
    >>> jax.jit(qmodel.apply)(variables, x, rngs={"quant": jax.random.key(1)}).shape
    (4, 8)
    """
    adapter = adapter_for(model)
    return adapter.quantize(model, Rules.of(rules), rngs=rngs, packed=packed, method=method,
                            implementation=resolve(implementation), observe=observe)


def sites(
    model, rules, *args, implementation: str | Implementation | None = None, **kwargs
) -> list[Site]:
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
    rules = Rules.of(rules)
    return adapter_for(model).sites(model, rules, args, kwargs,
                                    implementation=resolve(implementation))


def describe(
    model,
    rules,
    *args,
    implementation: str | Implementation | None = None,
    print_fn=print,
    **kwargs,
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
    impl = resolve(implementation)
    site_list, params = adapter_for(model).sites_and_params(model, rules, args, kwargs,
                                                            implementation=impl)
    out = rows(site_list, params)
    if print_fn is not None:
        print_fn(format_rows(out, rules, site_list))
    return out


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
    adapter = adapter_for(params, strict=False)
    if adapter is not None:  # a model: its adapter finds the parameters and the sites
        return adapter.pack(params, rules, sites)
    return pack_params(params, rules, layouts_of(sites))
