"""A decoder-only GPT in Flax NNX for the low-bit training experiments.

Pre-norm blocks (RMSNorm), causal multi-head self-attention with rotary (RoPE, rotate-half)
or learned positions, a dense GELU MLP or a token-choice top-k mixture of experts (with
capacity, GShard / Switch, or dropless over a grouped GEMM: ``moe_impl``), a final norm and
an LM head (tied to the embedding or not). The same GPT is the Llama family's (Llama,
Mistral, Qwen2, Qwen3, whose Hugging Face checkpoints :mod:`experiments.hf` loads): a SwiGLU
MLP (``mlp_act``), grouped-query attention (``kv_heads``), a head width of its own
(``head_size``), q/k/v biases, q/k norms, a sliding window, the RMSNorm epsilon and RoPE's
``linear`` and ``llama3`` scalings are config fields whose defaults keep the GPT as it was.

Every GEMM with a weight is an ``nnx.Linear`` or, for the expert weights, an ``nnx.Einsum``
(capacity) or a ``lowbit.flax.nnx.GroupedLinear`` (dropless), so that
:func:`lowbit.flax.quantize` reaches it by its path (``re.fullmatch`` on these):

================================  ======================================================
``embed``, ``pos_embed``          ``nnx.Embed`` (``pos_embed``: learned positions only)
``blocks/<i>/norm1``, ``norm2``   ``nnx.RMSNorm`` before attention / before the MLP
``blocks/<i>/attn/qkv``, ``out``  fused q/k/v projection (``d -> 3d``; grouped-query:
                                  ``d -> (heads + 2 kv_heads) head_dim``), output projection
``blocks/<i>/attn/q_norm``, ...   per-head RMSNorms of q and k (``qk_norm``, Qwen3)
``blocks/<i>/mlp/up``, ``down``   dense MLP ``d -> ffn -> d`` (``gate`` too: SwiGLU)
``blocks/<i>/moe/router``         ``nnx.Linear`` ``d -> experts``, computed in float32
``blocks/<i>/moe/up``, ``down``   kernels ``[E, d, f]`` and ``[E, f, d]`` (Einsum / Grouped)
``norm_f``, ``head``              final norm; LM head (untied only)
================================  ======================================================

The attention math (``q k^T / sqrt(d)``, causal mask, float32 softmax, ``p v``) is written with
``jnp.einsum`` and is not a quantization site: it stays in high precision.

Dtypes: parameters are float32; activations are computed in ``cfg.dtype``; the router, the LM
head, the logits and the loss are float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowbit.flax.nnx import GroupedLinear

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "Attention",
    "MLP",
    "MoE",
    "loss_fn",
    "n_params",
    "moe_capacity",
    "route",
    "route_dropless",
    "rope",
    "rope_frequencies",
]

POSITIONS = ("rope", "learned")
MLPS = ("dense", "moe")
MOE_IMPLS = ("capacity", "dropless")
MLP_ACTS = ("gelu", "swiglu")
# GPTConfig's Llama-family fields (added 2026-12-05; runs written before have their defaults)
LLAMA_FIELDS = ("mlp_act", "ffn_dim", "kv_heads", "head_size", "qkv_bias", "qk_norm",
                "norm_eps", "sliding_window", "rope_scaling", "rope_factor", "rope_low_freq",
                "rope_high_freq", "rope_original_len")
ROPE_SCALINGS = ("none", "linear", "llama3")
DTYPES = ("float32", "bfloat16")
INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a :class:`GPT`; validated on construction."""

    vocab: int = 256  # byte-level tokens
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    seq_len: int = 128  # max sequence length (size of the learned position table)
    positions: str = "rope"  # "rope" | "learned"
    tie_embeddings: bool = False  # True: logits = embed.attend(x); False: a `head` Linear
    mlp: str = "dense"  # "dense" | "moe"
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    capacity_multiple: int = 32  # capacity rounded up to this (lowbit blocks / Hadamards)
    moe_aux_weight: float = 0.01  # weight of the Switch load-balancing loss
    moe_impl: str = "capacity"  # "capacity" (expert buffers, drops) | "dropless" (ragged_dot)
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16" (parameters: float32)
    rope_base: float = 10000.0
    # The Llama family (Llama, Mistral, Qwen2, Qwen3; experiments.hf loads their checkpoints):
    mlp_act: str = "gelu"  # dense MLP: "gelu" (up, down) | "swiglu" (gate, up, down)
    ffn_dim: int = 0  # the MLP's hidden width; 0: mlp_ratio * d_model
    kv_heads: int = 0  # grouped-query attention's key/value heads; 0: heads (multi-head)
    head_size: int = 0  # per-head width; 0: d_model // heads (Qwen3 sets its own)
    qkv_bias: bool = False  # biases on the q/k/v projection (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3)
    norm_eps: float = 1e-6  # every RMSNorm's epsilon
    sliding_window: int = 0  # attend to the last this-many positions only (Mistral); 0: all
    rope_scaling: str = "none"  # "none" | "linear" | "llama3" (Llama 3.1's frequency bands)
    rope_factor: float = 1.0  # linear / llama3: the context extension factor
    rope_low_freq: float = 1.0  # llama3: low_freq_factor
    rope_high_freq: float = 4.0  # llama3: high_freq_factor
    rope_original_len: int = 8192  # llama3: original_max_position_embeddings

    def __post_init__(self):
        ints = ("vocab", "d_model", "layers", "heads", "mlp_ratio", "seq_len", "experts")
        for name in (*ints, "capacity_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.d_model % self.heads and not self.head_size:
            raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads} "
                             "(or set head_size)")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k!r} must be in [1, experts={self.experts}]")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor!r}")
        if not self.moe_aux_weight >= 0:
            raise ValueError(f"moe_aux_weight must be >= 0, got {self.moe_aux_weight!r}")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base!r}")
        self._check_llama()

    def _check_llama(self):
        for name in ("ffn_dim", "kv_heads", "head_size", "sliding_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: the default), got {v!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        if self.mlp_act != "gelu" and self.mlp == "moe":
            raise ValueError(f"mlp_act={self.mlp_act!r} is for the dense MLP; the MoE experts "
                             "are GELU MLPs")
        if self.heads % self.n_kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads="
                             f"{self.n_kv_heads}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {ROPE_SCALINGS}, got "
                             f"{self.rope_scaling!r}")
        if not (self.rope_factor >= 1 and self.norm_eps > 0 and self.rope_original_len >= 1
                and self.rope_high_freq > self.rope_low_freq > 0):
            raise ValueError(
                f"need rope_factor >= 1, norm_eps > 0, rope_original_len >= 1 and "
                f"rope_high_freq > rope_low_freq > 0; got {self.rope_factor!r}, "
                f"{self.norm_eps!r}, {self.rope_original_len!r}, {self.rope_high_freq!r}, "
                f"{self.rope_low_freq!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"positions='rope' needs an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_ff(self) -> int:
        return self.ffn_dim or self.mlp_ratio * self.d_model

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def n_params(cfg: GPTConfig) -> int:
    """The number of parameters of ``GPT(cfg)``, in closed form.

    >>> n_params(GPTConfig(d_model=64, layers=2, heads=4))
    131392
    """
    d, f, e = cfg.d_model, cfg.d_ff, cfg.experts
    mlp = e * d + 2 * e * d * f if cfg.mlp == "moe" else (2 + (cfg.mlp_act == "swiglu")) * d * f
    q, kv = cfg.heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = (d + cfg.qkv_bias) * (q + 2 * kv) + q * d + 2 * cfg.qk_norm * cfg.head_dim
    block = 2 * d + attn + mlp  # two norms, qkv (+ bias, q/k norms), out, MLP
    total = cfg.vocab * d + cfg.layers * block + d  # embed, blocks, norm_f
    if cfg.positions == "learned":
        total += cfg.seq_len * d
    if not cfg.tie_embeddings:
        total += d * cfg.vocab
    return total


def moe_capacity(cfg: GPTConfig, seq_len: int) -> int:
    """Slots per expert and sequence: ``ceil(capacity_factor * T * top_k / experts)``, rounded
    up to a multiple of ``capacity_multiple`` (default 32), and at most ``T`` rounded the same
    way (a token chooses an expert at most once, so no expert receives more than ``T``).

    lowbit blocks the expert weight-gradient GEMM along the capacity axis (blocks of 16 / 32)
    and its Hadamard transforms need the length to be a multiple of their size (16 for
    ``nvfp4``, 32 for ``quartet``, 64 for ``mxfp4_bwd``: use ``capacity_multiple=64`` there).
    ``capacity_factor >= experts / top_k`` drops nothing.

    >>> moe_capacity(GPTConfig(mlp="moe"), 128), moe_capacity(GPTConfig(mlp="moe"), 8)
    (96, 32)
    """

    def up(n: int) -> int:
        return -(-n // cfg.capacity_multiple) * cfg.capacity_multiple

    c = math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.experts)
    return min(up(c), up(seq_len))


# --------------------------------------------------------------------------------------------
# Pieces


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, *, std: float = INIT_STD, dtype=None,
            bias: bool = False):
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, kernel_init=_normal(std),
                      rngs=rngs)


def rope_frequencies(cfg: GPTConfig) -> np.ndarray:
    """RoPE's angular frequencies ``[head_dim / 2]`` (float32): ``base^(-2i/K)``, scaled by
    ``cfg.rope_scaling``: ``"linear"`` divides them by ``rope_factor``; ``"llama3"`` (Llama
    3.1) divides the low-frequency band (wavelengths above ``rope_original_len /
    rope_low_freq``) by ``rope_factor``, keeps the high-frequency band (wavelengths below
    ``rope_original_len / rope_high_freq``) and interpolates between them, as transformers'
    ``_compute_llama3_parameters`` does (huggingface/transformers,
    ``src/transformers/modeling_rope_utils.py``).

    >>> rope_frequencies(GPTConfig(d_model=8, heads=1)).tolist()
    [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513]
    """
    k = cfg.head_dim
    inv = (1.0 / cfg.rope_base ** (np.arange(0, k, 2, dtype=np.float64) / k))
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_scaling == "llama3":
        wavelen = 2 * np.pi / inv
        low_wavelen = cfg.rope_original_len / cfg.rope_low_freq
        high_wavelen = cfg.rope_original_len / cfg.rope_high_freq
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = ((cfg.rope_original_len / wavelen - cfg.rope_low_freq)
                  / (cfg.rope_high_freq - cfg.rope_low_freq))
        mid = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, mid, scaled)
    return inv.astype(np.float32)


def rope(x_BTHK: jax.Array, positions_T: jax.Array, base: float, freqs_F=None) -> jax.Array:
    """Rotary position embedding (rotate-half): feature pairs ``(i, i + K/2)`` rotated by the
    angle ``position * base^(-2i/K)`` (or ``position * freqs_F[i]``,
    :func:`rope_frequencies`); computed in float32, returned in ``x``'s dtype.

    >>> x = jnp.ones((1, 3, 1, 4))
    >>> bool(jnp.all(rope(x, jnp.zeros(3), 1e4) == x))
    True
    """
    k = x_BTHK.shape[-1]
    if freqs_F is None:
        freqs_F = base ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
    freqs_F = jnp.asarray(freqs_F, jnp.float32)
    angles_TF = positions_T.astype(jnp.float32)[:, None] * freqs_F[None, :]
    cos_TK = jnp.concatenate([jnp.cos(angles_TF)] * 2, axis=-1)[None, :, None, :]
    sin_TK = jnp.concatenate([jnp.sin(angles_TF)] * 2, axis=-1)[None, :, None, :]
    x = x_BTHK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos_TK + rotated * sin_TK).astype(x_BTHK.dtype)


class Attention(nnx.Module):
    """Self-attention: fused ``qkv`` projection (query heads, then key heads, then value heads,
    each ``head_dim`` wide), ``out`` projection; causal with RoPE (``cfg.positions ==
    "rope"``) for the GPT, with grouped-query heads (``kv_heads``: query head ``i`` reads
    key/value head ``i // (heads / kv_heads)``), optional q/k/v biases, per-head q/k RMSNorms
    (``q_norm``, ``k_norm``: Qwen3's, before RoPE) and a sliding window (Mistral's). The ViT's
    (:mod:`experiments.vision`) is bidirectional (``causal=False``, no RoPE) and runs its
    projections on ``[B * T, D]`` activations (``flat=True``: a weight gradient contracts
    every token of the batch). ``cfg``: any config with ``d_model``, ``heads``,
    ``head_dim``, ``layers`` and ``compute_dtype`` (and ``positions``, ``rope_base`` when
    causal; the Llama-family fields of :class:`GPTConfig` where it has them)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, causal: bool = True, flat: bool = False):
        d, dt = cfg.d_model, cfg.compute_dtype
        self.cfg = cfg
        self.causal = causal
        self.flat = flat
        self.rope = causal and cfg.positions == "rope"
        self.kv_heads = getattr(cfg, "n_kv_heads", cfg.heads)
        self.window = getattr(cfg, "sliding_window", 0)
        hd, q = cfg.head_dim, cfg.heads * cfg.head_dim
        scaled = self.rope and getattr(cfg, "rope_scaling", "none") != "none"
        self.freqs = tuple(rope_frequencies(cfg).tolist()) if scaled else None  # static
        self.qkv = _linear(d, q + 2 * self.kv_heads * hd, rngs, dtype=dt,
                           bias=getattr(cfg, "qkv_bias", False))
        self.out = _linear(q, d, rngs, std=INIT_STD / math.sqrt(2 * cfg.layers), dtype=dt)
        if getattr(cfg, "qk_norm", False):
            eps = cfg.norm_eps
            self.q_norm = nnx.RMSNorm(hd, epsilon=eps, dtype=dt, rngs=rngs)
            self.k_norm = nnx.RMSNorm(hd, epsilon=eps, dtype=dt, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, d = x_BTD.shape
        h, kv, k = cfg.heads, self.kv_heads, cfg.head_dim
        qkv_BTF = _flat_apply(self.qkv, x_BTD, self.flat)
        q_BTHK = qkv_BTF[..., : h * k].reshape(b, t, h, k)
        k_BTGK = qkv_BTF[..., h * k : (h + kv) * k].reshape(b, t, kv, k)
        v_BTGK = qkv_BTF[..., (h + kv) * k :].reshape(b, t, kv, k)
        if hasattr(self, "q_norm"):
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.rope:
            pos_T = jnp.arange(t)
            q_BTHK = rope(q_BTHK, pos_T, cfg.rope_base, self.freqs)
            k_BTGK = rope(k_BTGK, pos_T, cfg.rope_base, self.freqs)
        k_BTHK = jnp.repeat(k_BTGK, h // kv, axis=2) if kv != h else k_BTGK
        v_BTHK = jnp.repeat(v_BTGK, h // kv, axis=2) if kv != h else v_BTGK
        scores_BHTS = jnp.einsum(
            "bthk,bshk->bhts", q_BTHK, k_BTHK, preferred_element_type=jnp.float32
        ) / np.float32(math.sqrt(k))
        if self.causal:
            causal_TS = jnp.tril(jnp.ones((t, t), dtype=bool))
            if self.window:
                causal_TS = causal_TS & ~jnp.tril(causal_TS, -self.window)
            scores_BHTS = jnp.where(causal_TS[None, None], scores_BHTS, jnp.finfo(jnp.float32).min)
        probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1)
        y_BTHK = jnp.einsum(
            "bhts,bshk->bthk",
            probs_BHTS.astype(v_BTHK.dtype),
            v_BTHK,
            preferred_element_type=jnp.float32,
        ).astype(x_BTD.dtype)
        return _flat_apply(self.out, y_BTHK.reshape(b, t, h * k), self.flat)


class MLP(nnx.Module):
    """Dense MLP: ``up`` (d -> ffn), GELU, ``down``; or, with ``mlp_act="swiglu"`` (the Llama
    family's), ``down(silu(gate(x)) * up(x))``. ``flat``: on ``[B * T, D]`` activations (the
    ViT's, see :class:`Attention`)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, flat: bool = False):
        d, f, dt = cfg.d_model, cfg.d_ff, cfg.compute_dtype
        self.flat = flat
        if getattr(cfg, "mlp_act", "gelu") == "swiglu":
            self.gate = _linear(d, f, rngs, dtype=dt)
        self.up = _linear(d, f, rngs, dtype=dt)
        self.down = _linear(f, d, rngs, std=INIT_STD / math.sqrt(2 * cfg.layers), dtype=dt)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d) if self.flat else x_BTD
        if hasattr(self, "gate"):
            h = nnx.silu(self.gate(x)) * self.up(x)
        else:
            h = nnx.gelu(self.up(x))
        y = self.down(h)
        return y.reshape(b, t, d) if self.flat else y


def _flat_apply(linear: nnx.Linear, x_BTD: jax.Array, flat: bool) -> jax.Array:
    """``linear(x)``; with ``flat``, on ``x`` as a ``[B * T, D]`` matrix, reshaped back."""
    if not flat:
        return linear(x_BTD)
    b, t, d = x_BTD.shape
    return linear(x_BTD.reshape(b * t, d)).reshape(b, t, -1)


def route(
    logits_BTE: jax.Array, top_k: int, capacity: int, dtype=jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Token-choice top-k routing with capacity, per sequence (group = one row of the batch).

    Each token picks its ``top_k`` most probable experts; gates are the chosen probabilities
    renormalized over the ``k`` choices. A token's slot in its expert's buffer is its rank
    among the assignments to that expert, first choices of all tokens before second choices,
    then token order; assignments past ``capacity`` are dropped (gate 0).

    Returns ``dispatch_BTEC`` (one-hot, ``dtype``), ``combine_BTEC`` (gates, ``dtype``), the
    Switch load-balancing loss ``E * sum_e f_e p_e`` (``f_e``: fraction of tokens whose first
    choice is ``e``; ``p_e``: mean router probability; averaged over sequences; 1 when
    balanced, ``E`` when collapsed) and the fraction of assignments dropped (float32).

    >>> d, c, aux, dropped = route(jnp.zeros((1, 4, 2)), top_k=1, capacity=3)
    >>> d.shape, d[0, :, 0].sum(-1).tolist(), float(aux), float(dropped)
    ((1, 4, 2, 3), [1.0, 1.0, 1.0, 0.0], 1.0, 0.25)
    """
    b, t, e = logits_BTE.shape
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    gates_BTK, idx_BTK = jax.lax.top_k(probs_BTE, top_k)
    gates_BTK = gates_BTK / jnp.sum(gates_BTK, axis=-1, keepdims=True)
    mask_BTKE = jax.nn.one_hot(idx_BTK, e, dtype=jnp.int32)
    # priority: all first choices (in token order), then all second choices, ...
    mask_BNE = jnp.swapaxes(mask_BTKE, 1, 2).reshape(b, top_k * t, e)
    slot_BNE = jnp.cumsum(mask_BNE, axis=1) - 1
    slot_BTK = jnp.sum(slot_BNE * mask_BNE, axis=-1).reshape(b, top_k, t).swapaxes(1, 2)
    slot_BTKC = jax.nn.one_hot(slot_BTK, capacity, dtype=jnp.float32)  # zero when >= capacity
    mask_BTKE = mask_BTKE.astype(jnp.float32)
    dispatch_BTEC = jnp.einsum("btke,btkc->btec", mask_BTKE, slot_BTKC)
    combine_BTEC = jnp.einsum("btke,btk,btkc->btec", mask_BTKE, gates_BTK, slot_BTKC)
    first_BE = jnp.mean(mask_BTKE[:, :, 0, :], axis=1)
    prob_BE = jnp.mean(probs_BTE, axis=1)
    aux = jnp.mean(e * jnp.sum(first_BE * prob_BE, axis=-1))
    dropped = jnp.mean((slot_BTK >= capacity).astype(jnp.float32))
    return dispatch_BTEC.astype(dtype), combine_BTEC.astype(dtype), aux, dropped


def route_dropless(logits_BTE: jax.Array, top_k: int):
    """Token-choice top-k routing without capacity: every assignment is kept.

    The ``N = B T`` tokens are flattened. Returns ``order [N*k]`` (the assignments ``token *
    k + choice`` sorted by expert, stably: within an expert, token order then choice),
    ``group_sizes [E]`` (int32), ``gates [N, k]`` (the chosen probabilities renormalized over
    the ``k`` choices) and :func:`route`'s Switch load-balancing loss (per sequence, averaged).

    >>> order, sizes, gates, aux = route_dropless(jnp.array([[[0., 1.], [2., 0.], [0., 3.]]]),
    ...                                           1)
    >>> order.tolist(), sizes.tolist(), float(aux) > 1
    ([1, 0, 2], [1, 2], True)
    """
    b, t, e = logits_BTE.shape
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    gates_BTK, idx_BTK = jax.lax.top_k(probs_BTE, top_k)
    gates_BTK = gates_BTK / jnp.sum(gates_BTK, axis=-1, keepdims=True)
    expert_A = idx_BTK.reshape(-1)
    order = jnp.argsort(expert_A, stable=True)
    sizes = jnp.bincount(expert_A, length=e).astype(jnp.int32)
    first_BE = jnp.mean(jax.nn.one_hot(idx_BTK[:, :, 0], e, dtype=jnp.float32), axis=1)
    aux = jnp.mean(e * jnp.sum(first_BE * jnp.mean(probs_BTE, axis=1), axis=-1))
    return order, sizes, gates_BTK.reshape(b * t, top_k), aux


class MoE(nnx.Module):
    """Mixture of GELU-MLP experts with a float32 ``router``; the experts' kernels are ``up``
    ``[E, d, f]`` and ``down`` ``[E, f, d]`` under both ``moe_impl`` s (so checkpoints move
    between them):

    - ``"capacity"``: ``nnx.Einsum`` s over per-expert buffers ``[B, E, C, d]`` filled by
      :func:`route` (per sequence; assignments past the capacity are dropped);
    - ``"dropless"``: ``lowbit.flax.nnx.GroupedLinear`` s (``lb.ragged_dot``, a grouped
      GEMM over the assignments sorted by expert, :func:`route_dropless`): no capacity, no
      drops, no ``[B, T, E, C]`` dispatch tensors; rules reach ``moe/up`` and ``moe/down`` by
      path as grouped-GEMM sites.
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, f, e, dt = cfg.d_model, cfg.d_ff, cfg.experts, cfg.compute_dtype
        self.cfg = cfg
        self.router = _linear(d, e, rngs, dtype=jnp.float32)
        down_init = _normal(INIT_STD / math.sqrt(2 * cfg.layers))
        if cfg.moe_impl == "dropless":
            self.up = GroupedLinear(e, d, f, dtype=dt, kernel_init=_normal(INIT_STD),
                                    rngs=rngs)
            self.down = GroupedLinear(e, f, d, dtype=dt, kernel_init=down_init, rngs=rngs)
            return
        self.up = nnx.Einsum(
            "becd,edf->becf", (e, d, f), dtype=dt, kernel_init=_normal(INIT_STD), rngs=rngs
        )
        self.down = nnx.Einsum(
            "becf,efd->becd", (e, f, d), dtype=dt, kernel_init=down_init, rngs=rngs
        )

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (y_BTD, unweighted load-balancing loss, fraction of assignments dropped)."""
        cfg = self.cfg
        if cfg.moe_impl == "dropless":
            return self._dropless(x_BTD)
        capacity = moe_capacity(cfg, x_BTD.shape[1])
        logits_BTE = self.router(x_BTD)
        dispatch_BTEC, combine_BTEC, aux, dropped = route(
            logits_BTE, cfg.top_k, capacity, x_BTD.dtype
        )
        x_BECD = jnp.einsum("btd,btec->becd", x_BTD, dispatch_BTEC)
        y_BECD = self.down(nnx.gelu(self.up(x_BECD)))
        y_BTD = jnp.einsum("becd,btec->btd", y_BECD, combine_BTEC)
        return y_BTD, aux, dropped

    def _dropless(self, x_BTD):
        b, t, d = x_BTD.shape
        k = self.cfg.top_k
        x_ND = x_BTD.reshape(b * t, d)
        order_A, sizes_E, gates_NK, aux = route_dropless(self.router(x_BTD), k)
        x_AD = x_ND[order_A // k]  # assignments sorted by expert
        y_AD = self.down(nnx.gelu(self.up(x_AD, sizes_E)), sizes_E)
        y_NKD = jnp.zeros_like(y_AD).at[order_A].set(y_AD).reshape(b * t, k, d)
        y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))
        return y_ND.reshape(b, t, d), aux, jnp.float32(0)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``+ mlp|moe(norm2(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, cfg.compute_dtype
        self.norm1 = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=dt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=dt, rngs=rngs)
        if cfg.mlp == "moe":
            self.moe = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (x_BTD, load-balancing loss, dropped fraction); both 0 for a dense MLP."""
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD))
        h_BTD = self.norm2(x_BTD)
        if hasattr(self, "moe"):
            y_BTD, aux, dropped = self.moe(h_BTD)
        else:
            y_BTD, aux, dropped = self.mlp(h_BTD), jnp.float32(0), jnp.float32(0)
        return x_BTD + y_BTD, aux, dropped


class GPT(nnx.Module):
    """Decoder-only transformer over byte tokens; see the module docstring for paths.

    >>> cfg = GPTConfig(d_model=32, layers=1, heads=2, seq_len=16)
    >>> model = GPT(cfg, rngs=nnx.Rngs(0))
    >>> logits_BTV, aux = model(jnp.zeros((2, 16), jnp.int32))
    >>> logits_BTV.shape, logits_BTV.dtype, float(aux)
    ((2, 16, 256), dtype('float32'), 0.0)
    >>> n_params(cfg) == sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    True
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, d, embedding_init=_normal(INIT_STD), rngs=rngs)
        if cfg.positions == "learned":
            self.pos_embed = nnx.Embed(cfg.seq_len, d, embedding_init=_normal(INIT_STD), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm_f = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = _linear(d, cfg.vocab, rngs, dtype=jnp.float32)

    def __call__(self, tokens_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> (logits_BTV float32, aux_loss: the weighted MoE load-balancing loss summed over
        layers, float32; 0 for a dense MLP)."""
        logits_BTV, stats = self.forward(tokens_BT)
        return logits_BTV, stats["aux_loss"]

    def forward(self, tokens_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """-> (logits_BTV, {"aux_loss": weighted, summed over layers; "moe_dropped": the
        fraction of expert assignments dropped, averaged over layers (0 when dense)})."""
        cfg = self.cfg
        if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer array [batch, time], got {tokens_BT.dtype} "
                f"{tokens_BT.shape}"
            )
        t = tokens_BT.shape[1]
        x_BTD = self.embed(tokens_BT)
        if cfg.positions == "learned":
            if t > cfg.seq_len:
                raise ValueError(
                    f"{t} tokens per sequence, but positions='learned' has a table of "
                    f"seq_len={cfg.seq_len} positions"
                )
            x_BTD = x_BTD + self.pos_embed(jnp.arange(t))[None]
        x_BTD = x_BTD.astype(cfg.compute_dtype)
        aux, dropped = jnp.float32(0), jnp.float32(0)
        for block in self.blocks:
            x_BTD, aux_l, dropped_l = block(x_BTD)
            aux, dropped = aux + aux_l, dropped + dropped_l
        x_BTD = self.norm_f(x_BTD).astype(jnp.float32)
        if cfg.tie_embeddings:
            logits_BTV = self.embed.attend(x_BTD)
        else:
            logits_BTV = self.head(x_BTD)
        stats = {
            "aux_loss": (cfg.moe_aux_weight * aux).astype(jnp.float32),
            "moe_dropped": (dropped / cfg.layers).astype(jnp.float32),
        }
        return logits_BTV.astype(jnp.float32), stats


def loss_fn(model: GPT, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy plus the weighted MoE load-balancing loss.

    ``batch``: ``{"inputs": int32[B, T], "targets": int32[B, T]}``. Returns ``(loss, metrics)``
    with ``metrics = {"loss": cross-entropy, "aux_loss": aux}`` and, for MoE models,
    ``"moe_dropped"`` (the fraction of expert assignments over capacity).

    >>> model = GPT(GPTConfig(d_model=32, layers=1, heads=2, seq_len=8), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 8), jnp.int32)
    >>> loss, metrics = loss_fn(model, {"inputs": tokens, "targets": tokens})
    >>> abs(float(loss) - math.log(256)) < 0.1, sorted(metrics)
    (True, ['aux_loss', 'loss'])
    """
    logits_BTV, stats = model.forward(batch["inputs"])
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"]))
    aux = stats["aux_loss"]
    metrics = {"loss": ce, "aux_loss": aux}
    if model.cfg.mlp == "moe":
        metrics["moe_dropped"] = stats["moe_dropped"]
    return ce + aux, metrics
