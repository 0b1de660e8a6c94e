"""A small vision transformer on scikit-learn's handwritten digits: the second model family of
the low-bit training experiments (``configs/digits.py``; the loop is
:mod:`experiments.trainer`, which dispatches on ``config.family`` through
:mod:`experiments.families`).

Model (:class:`ViT`, Flax NNX): the image is cut into ``patch x patch`` patches, each flattened
and embedded by an ``nnx.Linear``; a learned position embedding is added; pre-norm transformer
blocks (LayerNorm, bidirectional multi-head self-attention, GELU MLP); a final norm, the mean
over patches and a linear classifier. Every GEMM with a weight is an ``nnx.Linear``, so that
:func:`lowbit.flax.quantize` reaches it by its path (``re.fullmatch`` on these):

================================  ======================================================
``embed``                         ``nnx.Linear`` ``patch * patch * channels -> d``
``pos_embed``                     ``nnx.Param`` ``[patches, d]`` (no GEMM)
``blocks/<i>/norm1``, ``norm2``   ``nnx.LayerNorm`` before attention / before the MLP
``blocks/<i>/attn/qkv``, ``out``  fused ``d -> 3d`` projection, output projection
``blocks/<i>/mlp/up``, ``down``   dense MLP ``d -> ratio d -> d``
``norm_f``, ``head``              final norm; classifier ``d -> classes`` (float32)
================================  ======================================================

The linear layers see their activations as 2-D ``[batch * patches, features]`` matrices (the
GEMMs an accelerator runs): a weight gradient contracts all the patch tokens of the batch, so
its blocks and Hadamard transforms run along ``batch_size * patches`` (a multiple of 32 with
the configs' batch sizes), not along the 16 patches of one image. The attention products
(``q k^T``, ``p v``) are ``jnp.einsum`` in float32 and not quantization sites. Keep
``d_model`` and ``mlp_ratio * d_model`` multiples of 32 so that MX blocks (32) and NVFP4 blocks
(16) tile the hidden GEMMs' contraction axes.

Data (:func:`load`): the 1,797 8x8 images of ``sklearn.datasets.load_digits()`` (bundled with
scikit-learn, no download), pixels scaled from 0..16 to [0, 1], split once into train and
validation by a permutation seeded by ``data.split_seed`` (``data.val_fraction`` of the images,
rounded, go to validation). :class:`Batches` draws resumable shuffled training batches
(``state()`` / ``restore()`` as :class:`experiments.data.Batches`); :func:`eval_batches` covers
the validation split in order, the last batch padded and masked by ``"weights"``.

>>> cfg = ViTConfig(d_model=32, layers=1, heads=2)
>>> model = nnx.eval_shape(lambda: ViT(cfg, rngs=nnx.Rngs(0)))  # abstract: shapes only
>>> graphdef, state = nnx.split(model)
>>> logits_BC, aux = jax.eval_shape(
...     lambda s, x: nnx.merge(graphdef, s)(x), state, jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)
... )
>>> logits_BC.shape, logits_BC.dtype, aux.shape
((3, 10), dtype('float32'), ())
>>> n_params(cfg) == sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
True
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.data import DataError
from experiments.model import MLP, Attention

__all__ = [
    "ViTConfig",
    "ViT",
    "Block",
    "Attention",
    "MLP",
    "loss_fn",
    "batch_sums",
    "n_params",
    "patchify",
    "DigitsDataConfig",
    "ImageSplit",
    "ImageDataset",
    "Batches",
    "eval_batches",
    "load",
    "DIGITS",
]

DTYPES = ("float32", "bfloat16")
INIT_STD = 0.02
DIGITS = "sklearn-digits"
PIXEL_MAX = 16.0  # load_digits' pixels are integers 0..16
DIGITS_CSV = "datasets/data/digits.csv.gz"  # inside the sklearn package


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shape and numerics of a :class:`ViT`; validated on construction (errors name the
    field)."""

    image_size: int = 8  # square images, image_size x image_size pixels
    patch: int = 2  # square patches; image_size must be a multiple
    channels: int = 1
    classes: int = 10
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16" (parameters: float32)

    def __post_init__(self):
        ints = ("image_size", "patch", "channels", "classes", "d_model", "layers", "heads")
        for name in (*ints, "mlp_ratio"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.image_size % self.patch:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch={self.patch}"
            )
        if self.classes < 2:
            raise ValueError(f"classes must be >= 2, got {self.classes}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def num_patches(self) -> int:
        """The sequence length of the transformer: ``(image_size // patch) ** 2``."""
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        """The features of one flattened patch (the embedding's contraction axis)."""
        return self.patch * self.patch * self.channels

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def n_params(cfg: ViTConfig) -> int:
    """The number of parameters of ``ViT(cfg)``, in closed form.

    >>> n_params(ViTConfig())
    100938
    """
    d, f, t = cfg.d_model, cfg.d_ff, cfg.num_patches
    block = 4 * d + 4 * d * d + 2 * d * f  # two LayerNorms (scale, bias), qkv, out, MLP
    embed = cfg.patch_dim * d + d + t * d  # kernel, bias, positions
    return embed + cfg.layers * block + 2 * d + d * cfg.classes + cfg.classes


def patchify(images_BHWC: jax.Array, patch: int) -> jax.Array:
    """``[B, H, W, C]`` -> ``[B, (H / p) * (W / p), p * p * C]``: patches in row-major order,
    each flattened row-major (pixel rows, then columns, then channels).

    >>> x = np.arange(16.0).reshape(1, 4, 4, 1)  # (NumPy arrays stay NumPy)
    >>> patchify(x, 2)[0, 1].tolist()  # the top-right patch
    [2.0, 3.0, 6.0, 7.0]
    """
    b, h, w, c = images_BHWC.shape
    x = images_BHWC.reshape(b, h // patch, patch, w // patch, patch, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


# --------------------------------------------------------------------------------------------
# Model


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, *, std: float = INIT_STD, dtype=None,
            bias: bool = False):
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=dtype,
        kernel_init=nnx.initializers.normal(stddev=std),
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``; the
    GPT's :class:`experiments.model.Attention` (bidirectional) and
    :class:`experiments.model.MLP`, both on ``[B * T, D]`` activations."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, cfg.compute_dtype
        self.norm1 = nnx.LayerNorm(d, dtype=dt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs, causal=False, flat=True)
        self.norm2 = nnx.LayerNorm(d, dtype=dt, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs, flat=True)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD))
        return x_BTD + self.mlp(self.norm2(x_BTD))


class ViT(nnx.Module):
    """A vision transformer classifier; see the module docstring for paths.

    ``__call__(images)`` takes ``[B, H, W]`` (one channel) or ``[B, H, W, C]`` images (any
    real dtype; computed as float32 pixels) and returns ``(logits [B, classes] float32, aux
    float32 0.0)``: the ``(logits, aux_loss)`` convention of :class:`experiments.model.GPT`,
    so that callers treat both families alike.
    """

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.cfg = cfg
        # Pixels in [0, 1]: a fan-in scaled init so that the patch content, not the position,
        # dominates the first residual stream.
        self.embed = nnx.Linear(
            cfg.patch_dim,
            d,
            kernel_init=nnx.initializers.lecun_normal(),
            rngs=rngs,
        )
        self.pos_embed = nnx.Param(
            nnx.initializers.normal(stddev=INIT_STD)(rngs.params(), (cfg.num_patches, d))
        )
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm_f = nnx.LayerNorm(d, dtype=cfg.compute_dtype, rngs=rngs)
        self.head = _linear(d, cfg.classes, rngs, dtype=jnp.float32, bias=True)

    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        given = images.shape
        if images.ndim == 3 and cfg.channels == 1:
            images = images[..., None]
        want = (cfg.image_size, cfg.image_size, cfg.channels)
        if images.ndim != 4 or tuple(images.shape[1:]) != want:
            s = cfg.image_size
            alt = f" or [batch, {s}, {s}]" if cfg.channels == 1 else ""
            raise ValueError(
                f"images must be [batch, {s}, {s}, {cfg.channels}]{alt}, got {given}"
            )
        x_BTP = patchify(images.astype(jnp.float32), cfg.patch)
        b, t, p = x_BTP.shape
        x_BTD = self.embed(x_BTP.reshape(b * t, p)).reshape(b, t, cfg.d_model)
        x_BTD = (x_BTD + self.pos_embed[...][None]).astype(cfg.compute_dtype)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        x_BD = jnp.mean(self.norm_f(x_BTD).astype(jnp.float32), axis=1)
        logits_BC = self.head(x_BD)
        return logits_BC.astype(jnp.float32), jnp.float32(0)


def batch_sums(logits_BC: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums over a batch, float32: ``loss_sum`` (cross-entropy), ``correct`` (argmax ==
    target) and ``count``, each example weighted by ``batch["weights"]`` (1 when absent; 0
    marks the padding of the last validation batch)."""
    targets_B = batch["targets"]
    ce_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, targets_B)
    correct_B = (jnp.argmax(logits_BC, axis=-1) == targets_B).astype(jnp.float32)
    w_B = batch.get("weights")
    if w_B is None:
        w_B = jnp.ones(targets_B.shape, jnp.float32)
    return {
        "loss_sum": jnp.sum(w_B * ce_B),
        "correct": jnp.sum(w_B * correct_B),
        "count": jnp.sum(w_B),
    }


def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of ``model(batch["inputs"])`` against ``batch["targets"]`` plus the
    model's aux loss (0 for a :class:`ViT`).

    ``batch``: ``{"inputs": float32[B, 8, 8], "targets": int32[B]}`` (optional ``"weights"``,
    see :func:`batch_sums`). Returns ``(loss, {"loss": cross-entropy, "accuracy": fraction
    correct})``.

    >>> cfg = ViTConfig(d_model=32, layers=1, heads=2)
    >>> graphdef, state = nnx.split(nnx.eval_shape(lambda: ViT(cfg, rngs=nnx.Rngs(0))))
    >>> batch = {"inputs": jnp.zeros((4, 8, 8)), "targets": jnp.arange(4, dtype=jnp.int32)}
    >>> loss, metrics = jax.eval_shape(lambda s: loss_fn(nnx.merge(graphdef, s), batch), state)
    >>> loss.shape, sorted(metrics)
    ((), ['accuracy', 'loss'])
    """
    logits_BC, aux = model(batch["inputs"])
    s = batch_sums(logits_BC, batch)
    ce = s["loss_sum"] / s["count"]
    return ce + aux, {"loss": ce, "accuracy": s["correct"] / s["count"]}


# --------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class DigitsDataConfig:
    """The split of scikit-learn's digits: ``val_fraction`` of the images (rounded) go to
    validation, chosen by a permutation seeded by ``split_seed`` (fixed: the same for every
    run, recipe and training seed)."""

    val_fraction: float = 0.2
    split_seed: int = 0

    def __post_init__(self):
        vf = self.val_fraction
        if isinstance(vf, bool) or not isinstance(vf, int | float) or not 0.0 < vf < 1.0:
            raise DataError(f"data.val_fraction must be a number in (0, 1), got {vf!r}")
        s = self.split_seed
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise DataError(f"data.split_seed must be a non-negative integer, got {s!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSplit:
    images: np.ndarray  # float32 [N, H, W] in [0, 1]
    labels: np.ndarray  # int32 [N]
    indices: np.ndarray  # int64 [N]: the rows of the source data set, ascending

    def __len__(self) -> int:
        return len(self.labels)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageDataset:
    """The two splits of one image source; ``fingerprint`` (16 hex digits) covers the pixels,
    the labels and the split (a checkpoint's data position is only valid for the same one)."""

    train: ImageSplit
    val: ImageSplit
    fingerprint: str
    name: str = DIGITS


def _digits_file() -> pathlib.Path | None:
    """scikit-learn's bundled ``datasets/data/digits.csv.gz`` (what ``load_digits`` reads),
    found without importing scikit-learn (whose import takes seconds: scipy.stats)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the digits data set needs scikit-learn (a dependency of this package: "
            "pip install -e .)"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / DIGITS_CSV
    return path if path.is_file() else None


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits()``'s images (float32, scaled to [0, 1]) and labels
    (int32), read once per process: from the bundled CSV (64 pixels and the label per row, as
    ``load_digits`` parses it), or through ``load_digits`` where the file is not found."""
    path = _digits_file()
    if path is not None:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        if data.ndim != 2 or data.shape[1] != 65:
            raise DataError(f"{path}: expected rows of 64 pixels and a label, got {data.shape}")
        pixels, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
    else:  # pragma: no cover - a scikit-learn that keeps its data elsewhere
        from sklearn.datasets import load_digits

        d = load_digits()
        pixels, target = d.images, d.target
    if pixels.min() < 0 or pixels.max() > PIXEL_MAX or set(np.unique(target)) != set(range(10)):
        raise DataError("the digits data set has pixels outside 0..16 or labels outside 0..9")
    images = (np.asarray(pixels, np.float64) / PIXEL_MAX).astype(np.float32)
    labels = np.asarray(target).astype(np.int32)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load(cfg: DigitsDataConfig = DigitsDataConfig(), *, log=print) -> ImageDataset:
    """The digits, split by ``cfg`` (deterministic: the same arrays in every process).

    >>> ds = load(DigitsDataConfig(val_fraction=0.2), log=lambda *_: None)
    >>> len(ds.train), len(ds.val), ds.train.images.shape[1:], float(ds.train.images.max())
    (1438, 359, (8, 8), 1.0)
    """
    images, labels = _digits()
    n = len(labels)
    n_val = min(n - 1, max(1, round(n * cfg.val_fraction)))
    perm = np.random.default_rng(cfg.split_seed).permutation(n)
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    h = hashlib.sha256()
    for a in (images, labels, train_idx, val_idx):
        h.update(np.ascontiguousarray(a).tobytes())

    def split(idx):
        return ImageSplit(images[idx], labels[idx], idx)

    log(f"data: {DIGITS}: {len(train_idx):,} train / {n_val:,} val images")
    return ImageDataset(split(train_idx), split(val_idx), h.hexdigest()[:16])


def _check_positive(**kwargs) -> None:
    for k, v in kwargs.items():
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise DataError(f"{k} must be a positive integer, got {v!r}")


class Batches:
    """Deterministic, resumable training batches of ``batch_size`` examples of a split.

    Epoch ``e`` is a permutation, seeded by ``(seed, e)``, of the split's ``n`` examples;
    example ``w`` of the stream is ``perm_e[w % n]`` with ``e = w // n`` (a batch may span two
    epochs). The state is one integer, ``position``, the number of examples drawn: a restored
    stream continues the uninterrupted one exactly (the API of
    :class:`experiments.data.Batches`).

    >>> ds = load(log=lambda *_: None)
    >>> stream = Batches(ds.train, batch_size=4, seed=0)
    >>> b = next(stream); b["inputs"].shape, b["inputs"].dtype, b["targets"].dtype
    ((4, 8, 8), dtype('float32'), dtype('int32'))
    >>> stream.state()
    {'position': 4, 'seed': 0, 'batch_size': 4}
    >>> resumed = Batches.restore(ds.train, stream.state(), batch_size=4, seed=0)
    >>> bool(np.all(next(resumed)["targets"] == next(stream)["targets"]))
    True
    """

    def __init__(self, split: ImageSplit, *, batch_size: int, seed: int, position: int = 0):
        _check_positive(batch_size=batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise DataError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(position, bool) or not isinstance(position, int | np.integer) or position < 0:
            raise DataError(f"position must be a non-negative integer, got {position!r}")
        if len(split) == 0:
            raise DataError("Batches: the split has no examples")
        self.split = split
        self.batch_size, self.seed, self.position = int(batch_size), int(seed), int(position)
        self._epoch: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch = (epoch, rng.permutation(len(self.split)))
        return self._epoch[1]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        w = np.arange(self.position, self.position + self.batch_size)
        epochs, idx = np.divmod(w, len(self.split))
        rows = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            rows[sel] = self._perm(int(e))[idx[sel]]
        self.position += self.batch_size
        return {
            "inputs": np.ascontiguousarray(self.split.images[rows]),
            "targets": np.ascontiguousarray(self.split.labels[rows]),
        }

    def state(self) -> dict:
        """JSON-able state: the position and the arguments that must match on restore."""
        return {"position": self.position, "seed": self.seed, "batch_size": self.batch_size}

    @classmethod
    def restore(cls, split: ImageSplit, state: dict, *, batch_size: int, seed: int) -> Batches:
        """The stream that continues a saved one; its seed and batch_size must match."""
        for field, value in {"seed": seed, "batch_size": batch_size}.items():
            if field not in state:
                raise DataError(f"cannot resume the batch stream: the saved state lacks {field}")
            if state[field] != value:
                raise DataError(
                    f"cannot resume the batch stream: it was saved with {field}={state[field]!r} "
                    f"but {field}={value!r} is requested"
                )
        if "position" not in state:
            raise DataError("cannot resume the batch stream: the saved state lacks position")
        return cls(split, batch_size=batch_size, seed=seed, position=state["position"])


def eval_batches(
    split: ImageSplit, *, batch_size: int, max_batches: int
) -> list[dict[str, np.ndarray]]:
    """Fixed validation batches: the split in order, ``batch_size`` examples each, at most
    ``max_batches`` of them (enough covers the whole split). The last batch is padded to
    ``batch_size`` with copies of the split's first examples, weighted 0 (``"weights"``:
    float32, 1 for real examples), so that every batch has one shape.

    >>> ds = load(log=lambda *_: None)
    >>> bs = eval_batches(ds.val, batch_size=64, max_batches=100)
    >>> len(bs), sum(float(b["weights"].sum()) for b in bs) == len(ds.val)
    (6, True)
    """
    _check_positive(batch_size=batch_size, max_batches=max_batches)
    n = len(split)
    out = []
    for start in range(0, n, batch_size)[:max_batches]:
        rows = np.arange(start, start + batch_size)
        real = rows < n
        rows = np.where(real, rows, rows % n)
        out.append(
            {
                "inputs": np.ascontiguousarray(split.images[rows]),
                "targets": np.ascontiguousarray(split.labels[rows]),
                "weights": real.astype(np.float32),
            }
        )
    return out
