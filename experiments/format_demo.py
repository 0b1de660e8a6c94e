"""Quantization error of every registered format on a weight-like matrix.

Launch: ``python -m experiments.format_demo`` (what ``make demo`` runs), or
``python -m experiments.format_demo --size 4096 4096 --scale-mode rceil``.

The matrix imitates a trained LLM weight ``w[out, in]``: a Student-t bulk, log-normal row and
column scales and a few input columns several times larger than the rest (outlier features).
Blocks run along the input (contraction) axis, ``axis=-1``, as for ``y = x @ w.T``.

>>> rows = format_error_rows(weight_like((32, 64)), ["mxfp4"])
>>> rows[0].format, rows[0].qarray_bytes
('mxfp4', 1088)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import lowbit as lb
from lowbit.core.qarray import SCALE_MODES

__all__ = [
    "FormatRow",
    "weight_like",
    "format_error_rows",
    "render_table",
    "int4_scale_errors",
    "main",
]


@dataclasses.dataclass(frozen=True)
class FormatRow:
    """Error and size of one format on one tensor (errors against the float32 input)."""

    format: str
    bits_per_element: float  # nominal: element bits + the block scale's share
    sqnr_db: float  # 10 log10(sum x^2 / sum (x - q)^2)
    rel_rms_error: float  # rms(x - q) / rms(x) = 10 ** (-sqnr_db / 20)
    max_abs_error: float
    saturated: float  # fraction of elements clipped to the element max (|x| / scale > max)
    qarray_bytes: int  # QArray.nbytes: packed codes + scales (+ NVFP4 tensor scale)
    float32_bytes: int


def weight_like(
    shape: tuple[int, int] = (1024, 1024), *, seed: int = 0, std: float = 0.02
) -> np.ndarray:
    """A seeded float32 matrix ``[out, in]`` with the statistics of a trained LLM weight.

    Student-t (4 degrees of freedom) entries, times log-normal row scales (sigma 0.3) and
    column scales (sigma 0.8), with 1 % of the input columns a further 5-20x larger; scaled to
    an RMS of ``std``.

    >>> w = weight_like((8, 16), seed=1)
    >>> w.shape, w.dtype, bool(np.all(w == weight_like((8, 16), seed=1)))
    ((8, 16), dtype('float32'), True)
    """
    rng = np.random.default_rng(seed)
    m, n = shape
    bulk = rng.standard_t(4, size=(m, n))
    row_scale = np.exp(0.3 * rng.standard_normal((m, 1)))
    col_scale = np.exp(0.8 * rng.standard_normal((1, n)))
    hot = rng.random((1, n)) < 0.01
    col_scale = np.where(hot, col_scale * rng.uniform(5.0, 20.0, (1, n)), col_scale)
    w = bulk * row_scale * col_scale
    return (std * w / np.sqrt(np.mean(w**2))).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("fmt", "scale_mode"))
def _quantize(x, fmt: str, scale_mode: str | None):
    """(QArray, its dequantized values, mask of saturated elements)."""
    q = lb.quantize(x, fmt, axis=-1, scale_mode=scale_mode)

    # With clip_gradient=True the STE gradient is zero exactly where an element clipped.
    def fq(v):
        return lb.fake_quantize(v, fmt, axis=-1, scale_mode=scale_mode, clip_gradient=True)

    _, vjp = jax.vjp(fq, x)
    (g,) = vjp(jnp.ones_like(x))
    return q, lb.dequantize(q, jnp.float32), g == 0


def format_error_rows(
    x: np.ndarray | jax.Array,
    formats: Sequence[str] | None = None,
    scale_mode: str | None = None,
) -> list[FormatRow]:
    """One :class:`FormatRow` per format (default: every registered format, sorted by name).

    ``scale_mode`` applies to the MX formats (default: their OCP ``"floor"`` rule); NVFP4 has a
    single scale rule and ignores it.

    >>> [r.format for r in format_error_rows(weight_like((4, 32)), ["nvfp4", "mxfp8"])]
    ['nvfp4', 'mxfp8']
    """
    x = jnp.asarray(x, jnp.float32)
    x64 = np.asarray(x, np.float64)
    signal = np.sum(x64**2)
    rows = []
    for name in lb.formats.names() if formats is None else formats:
        fmt = lb.formats.get(name)
        q, y, sat = _quantize(x, name, scale_mode if fmt.is_mx else None)
        err = x64 - np.asarray(y, np.float64)
        noise = np.sum(err**2)
        rows.append(
            FormatRow(
                format=name,
                bits_per_element=fmt.bits_per_element,
                sqnr_db=float(10.0 * np.log10(signal / noise)),
                rel_rms_error=float(np.sqrt(noise / signal)),
                max_abs_error=float(np.max(np.abs(err))),
                saturated=float(np.mean(np.asarray(sat))),
                qarray_bytes=int(q.nbytes),
                float32_bytes=int(x.size * 4),
            )
        )
    return rows


_HEADER = (
    "format",
    "bits/elem",
    "SQNR dB",
    "rel RMS err",
    "max abs err",
    "saturated",
    "QArray bytes",
    "fp32 bytes",
    "fp32/QArray",
)


def _cells(r: FormatRow) -> tuple[str, ...]:
    return (
        r.format,
        f"{r.bits_per_element:g}",
        f"{r.sqnr_db:.2f}",
        f"{r.rel_rms_error:.4f}",
        f"{r.max_abs_error:.3e}",
        f"{100 * r.saturated:.3f}%",
        f"{r.qarray_bytes:,}",
        f"{r.float32_bytes:,}",
        f"{r.float32_bytes / r.qarray_bytes:.2f}x",
    )


def render_table(rows: Sequence[FormatRow]) -> str:
    """Plain aligned text: the format name left-aligned, numbers right-aligned."""
    table = [_HEADER] + [_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEADER))]
    lines = []
    for k, row in enumerate(table):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_rows(rows: Sequence[FormatRow], title: str, plain: bool) -> None:
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(render_table(rows))
        return
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(_HEADER):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for r in rows:
        table.add_row(*_cells(r))
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)


# INT4 under other scale rules than the registered int4's (an E4M3 block scale relative to a
# float32 tensor scale, NVFP4's): a power-of-two E8M0 scale as an MX format would take it.
_INT4_VARIANTS = {
    "int4 (E4M3 scale, blocks of 16)": ("int4", None),
    "int4, E8M0 floor scale, 16": (lb.BlockFormat("int4_e8m0_16", lb.formats.INT4,
                                                  lb.formats.E8M0, 16), "floor"),
    "int4, E8M0 rceil scale, 16": (lb.BlockFormat("int4_e8m0_16", lb.formats.INT4,
                                                  lb.formats.E8M0, 16), "rceil"),
    "int4, E8M0 floor scale, 32": (lb.BlockFormat("int4_e8m0_32", lb.formats.INT4,
                                                  lb.formats.E8M0, 32), "floor"),
    "nvfp4": ("nvfp4", None),
    "mxfp4": ("mxfp4", None),
}


_DISTRIBUTIONS = ("gaussian", "laplace", "student_t3")


def int4_scale_errors(
    n: int = 2**20, seed: int = 0, distributions: Sequence[str] = _DISTRIBUTIONS
) -> dict[str, dict[str, float]]:
    """Relative MSE (``sum (q - x)^2 / sum x^2``) of INT4 under each scale rule, with NVFP4 and
    MXFP4 beside it, on ``n`` samples of a Gaussian, a Laplace and a Student t (3 degrees of
    freedom): why ``int4`` takes NVFP4's E4M3 block scale (``lowbit/core/formats.py``).

    >>> g = int4_scale_errors(2**14, distributions=["gaussian"])["gaussian"]
    >>> g["int4 (E4M3 scale, blocks of 16)"] < g["int4, E8M0 floor scale, 16"]
    True
    """
    rng = np.random.default_rng(seed)
    data = {
        "gaussian": rng.standard_normal(n),
        "laplace": rng.laplace(size=n),
        "student_t3": rng.standard_t(3, size=n),
    }
    out = {}
    for name in distributions:
        x = jnp.asarray(data[name].reshape(-1, 256), jnp.float32)
        x64 = np.asarray(x, np.float64)
        out[name] = {
            k: float(np.sum((np.asarray(lb.fake_quantize(x, f, scale_mode=m), np.float64)
                             - x64) ** 2) / np.sum(x64**2))
            for k, (f, m) in _INT4_VARIANTS.items()
        }
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, nargs=2, default=(1024, 1024), metavar=("OUT", "IN"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale-mode",
        choices=SCALE_MODES,
        default=None,
        help="MX shared-exponent rule (default: floor, OCP MX v1.0)",
    )
    parser.add_argument("--plain", action="store_true", help="plain text even if rich is present")
    parser.add_argument(
        "--int4-scales",
        action="store_true",
        help="instead: INT4's relative MSE under E4M3 and E8M0 block scales (and NVFP4, MXFP4)",
    )
    args = parser.parse_args(argv)
    if args.int4_scales:
        errors = int4_scale_errors(seed=args.seed)
        names = list(_INT4_VARIANTS)
        print("relative MSE x 1e3 | " + " | ".join(names))
        for dist, row in errors.items():
            print(f"{dist} | " + " | ".join(f"{1e3 * row[k]:.2f}" for k in names))
        return

    w = weight_like(tuple(args.size), seed=args.seed)
    rows = format_error_rows(w, scale_mode=args.scale_mode)
    m, n = w.shape
    title = (
        f"Weight-like float32 [{m}, {n}] (seed {args.seed}), blocks along axis -1, "
        f"MX scale_mode={args.scale_mode or 'floor'}"
    )
    _print_rows(rows, title, args.plain)
    w64 = w.astype(np.float64)
    bf16 = np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float64)
    ref = 10 * np.log10(np.sum(w64**2) / np.sum((w64 - bf16) ** 2))
    print(f"Reference: a plain bfloat16 cast (16 bits/elem) has SQNR {ref:.2f} dB.")
    print(
        "bits/elem counts element bits plus the block scale's share (NVFP4's single float32 "
        "tensor scale is not counted); saturated = clipped to the element max."
    )


if __name__ == "__main__":
    main()
