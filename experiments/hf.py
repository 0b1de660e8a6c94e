"""Hugging Face checkpoints of the Llama family in: Llama, Mistral, Qwen2 and Qwen3.

:func:`load` reads a Hugging Face model directory (``config.json`` and ``model.safetensors``,
or shards listed by ``model.safetensors.index.json``) and returns the :class:`GPT` that
computes what transformers' PyTorch implementation of that config computes, with its weights:

=====================================================  ========================================
Hugging Face tensor                                    GPT parameter
=====================================================  ========================================
``model.embed_tokens.weight`` ``[V, D]``               ``embed/embedding``
``model.layers.i.input_layernorm.weight``              ``blocks/i/norm1/scale``
``model.layers.i.self_attn.{q,k,v}_proj.weight``       ``blocks/i/attn/qkv/kernel`` ``[D, Q+2KV]``
(``[out, in]`` each, and their biases: Qwen2)          (transposed, concatenated q, k, v)
``model.layers.i.self_attn.o_proj.weight``             ``blocks/i/attn/out/kernel`` (transposed)
``model.layers.i.self_attn.{q,k}_norm.weight``         ``blocks/i/attn/{q,k}_norm/scale`` (Qwen3)
``model.layers.i.post_attention_layernorm.weight``     ``blocks/i/norm2/scale``
``model.layers.i.mlp.{gate,up,down}_proj.weight``      ``blocks/i/mlp/{gate,up,down}/kernel``
``model.norm.weight``                                  ``norm_f/scale``
``lm_head.weight`` (absent when tied)                  ``head/kernel`` (transposed)
=====================================================  ========================================

The GPT's RoPE is transformers' (rotate-half over the first and second half of each head,
which is how Hugging Face checkpoints of these models store q and k), with ``rope_theta``
and the ``linear`` and ``llama3`` ``rope_scaling`` types; grouped-query heads, Qwen3's
``head_dim`` and q/k norms, Mistral's ``sliding_window`` and the RMSNorm epsilon are taken
from the config. Parameters are float32 whatever the checkpoint's dtype (bfloat16 weights
convert exactly).

Not supported, with an error that says so: other architectures, Llama's ``attention_bias``
(an ``o_proj`` bias) and ``mlp_bias``, other ``rope_scaling`` types (``yarn``, ``dynamic``,
``longrope``), Qwen2's per-layer sliding windows (``use_sliding_window``), activations other
than SiLU. Tokenizers are the user's business: lowbit's data pipeline is byte-level, so a
checkpoint trained with another vocabulary is run on token ids the user supplies (any
``vocab_size`` loads).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.model import GPT, GPTConfig
from lowbit.io.tree import is_qarray
from lowbit.io.views import as_rows, take_rows

__all__ = ["ARCHITECTURES", "load", "load_params", "gpt_config", "architecture", "hf_config",
           "to_hf", "site_of", "read_tensors", "UnsupportedCheckpoint"]

# transformers' class names -> model_type, the architectures this module maps
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint this module cannot map onto the GPT, or whose tensors disagree with its
    config: the message names what and why."""


def _arch(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if known:
        return known[0]
    if not archs and model_type in ARCHITECTURES.values():
        return model_type
    raise UnsupportedCheckpoint(
        f"{where}: architecture {archs or model_type!r} is not supported; supported: "
        f"{sorted(ARCHITECTURES)} (model_type {sorted(set(ARCHITECTURES.values()))})"
    )


def _rope(cfg: dict, where: str) -> dict:
    """RoPE's base and scaling: transformers 4 writes ``rope_theta`` and ``rope_scaling``,
    transformers 5 one ``rope_parameters`` dict holding both."""
    rs = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = {"rope_base": float(cfg.get("rope_theta") or rs.get("rope_theta") or 10000.0)}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return theta
    if kind == "linear":
        return {**theta, "rope_scaling": "linear", "rope_factor": float(rs["factor"])}
    if kind == "llama3":
        return {
            **theta,
            "rope_scaling": "llama3",
            "rope_factor": float(rs["factor"]),
            "rope_low_freq": float(rs["low_freq_factor"]),
            "rope_high_freq": float(rs["high_freq_factor"]),
            "rope_original_len": int(rs["original_max_position_embeddings"]),
        }
    raise UnsupportedCheckpoint(
        f"{where}: rope_scaling type {kind!r} is not supported (supported: default, linear, "
        "llama3)"
    )


def gpt_config(cfg: dict, *, dtype: str = "float32", where: str = "config.json") -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (as a dict) of a supported
    architecture. Raises :class:`UnsupportedCheckpoint` naming what cannot be mapped."""
    arch = _arch(cfg, where)
    for key in ("hidden_act", "hidden_activation"):
        if cfg.get(key, "silu") != "silu":
            raise UnsupportedCheckpoint(f"{where}: {key}={cfg[key]!r}; the Llama family's "
                                        "SwiGLU MLP uses silu")
    if cfg.get("mlp_bias"):
        raise UnsupportedCheckpoint(f"{where}: mlp_bias=true is not supported")
    if arch in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        raise UnsupportedCheckpoint(f"{where}: attention_bias=true ({arch}: biases on q, k, v "
                                    "and o_proj) is not supported; Qwen2's q/k/v biases are")
    window = 0
    if arch == "mistral" and cfg.get("sliding_window"):
        window = int(cfg["sliding_window"])
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise UnsupportedCheckpoint(f"{where}: use_sliding_window=true ({arch}'s per-layer "
                                    "windows) is not supported")
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or d // heads)
    try:
        return GPTConfig(
            vocab=int(cfg["vocab_size"]),
            d_model=d,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_size=head_dim if head_dim * heads != d else 0,
            ffn_dim=int(cfg["intermediate_size"]),
            seq_len=int(cfg.get("max_position_embeddings", 2048)),
            positions="rope",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp="dense",
            mlp_act="swiglu",
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            sliding_window=window,
            dtype=dtype,
            **_rope(cfg, where),
        )
    except KeyError as e:
        raise UnsupportedCheckpoint(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{where}: {e}") from None


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's safetensors (one file, or the shards that
    ``model.safetensors.index.json`` lists), as float32 NumPy arrays."""
    from lowbit.io import read_safetensors

    out = read_safetensors(Path(path))
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def _expect(tensors: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise UnsupportedCheckpoint(f"checkpoint: tensor {name!r} is missing (expected shape "
                                    f"{shape} from config.json)")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise UnsupportedCheckpoint(f"checkpoint: tensor {name!r} has shape {tuple(t.shape)}, "
                                    f"config.json implies {tuple(shape)}")
    return t


def _params(cfg: GPTConfig, t: dict[str, np.ndarray]) -> dict:
    """The GPT's parameter values by path (tuples of keys), from Hugging Face tensors."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab
    hd, q, kv = cfg.head_dim, cfg.heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {("embed", "embedding"): _expect(t, "model.embed_tokens.weight", (v, d)),
           ("norm_f", "scale"): _expect(t, "model.norm.weight", (d,))}
    if not cfg.tie_embeddings:
        out[("head", "kernel")] = _expect(t, "lm_head.weight", (v, d)).T
    for i in range(cfg.layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        a = p + "self_attn."
        out[b + ("norm1", "scale")] = _expect(t, p + "input_layernorm.weight", (d,))
        out[b + ("norm2", "scale")] = _expect(t, p + "post_attention_layernorm.weight", (d,))
        widths = (("q", q), ("k", kv), ("v", kv))
        qkv = [_expect(t, f"{a}{n}_proj.weight", (m, d)) for n, m in widths]
        out[b + ("attn", "qkv", "kernel")] = np.concatenate(qkv, axis=0).T
        if cfg.qkv_bias:
            bias = [_expect(t, f"{a}{n}_proj.bias", (m,)) for n, m in widths]
            out[b + ("attn", "qkv", "bias")] = np.concatenate(bias)
        out[b + ("attn", "out", "kernel")] = _expect(t, a + "o_proj.weight", (d, q)).T
        if cfg.qk_norm:
            out[b + ("attn", "q_norm", "scale")] = _expect(t, a + "q_norm.weight", (hd,))
            out[b + ("attn", "k_norm", "scale")] = _expect(t, a + "k_norm.weight", (hd,))
        for n, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            out[b + ("mlp", n, "kernel")] = _expect(t, f"{p}mlp.{n}_proj.weight", shape).T
    return out


def load(path: str | Path, *, dtype: str = "float32") -> tuple[GPT, GPTConfig]:
    """``(model, config)``: the :class:`GPT` of the Hugging Face directory ``path``
    (``config.json`` + safetensors) with its weights, and its :class:`GPTConfig`
    (``dtype``: the compute dtype; parameters are float32).

    Raises :class:`UnsupportedCheckpoint` for an unsupported architecture or option (naming
    what is supported) and for a tensor missing or of a shape its config does not imply
    (naming the tensor)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UnsupportedCheckpoint(f"{path}: no config.json (a Hugging Face model directory "
                                    "holds config.json and model.safetensors)")
    cfg = gpt_config(json.loads(cfg_file.read_text()), dtype=dtype, where=str(cfg_file))
    values = _params(cfg, read_tensors(path))
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    keys = [k for k, _ in nnx.to_flat_state(params)]
    missing = sorted(set(keys) - set(values), key=str)
    if missing:  # a GPT parameter no mapping fills: a bug here, not the checkpoint's
        raise AssertionError(f"experiments.hf: no Hugging Face tensor maps onto {missing}")
    filled = jax.tree.map(lambda _: None, params)  # the structure, values set below
    flat = nnx.to_flat_state(filled)
    for key, var in flat:
        var.set_value(jnp.asarray(values[key], jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest), cfg


def load_params(path: str | Path, expected: GPTConfig):
    """The GPT parameters (an ``nnx.State`` of Params) of the Hugging Face directory ``path``,
    whose config must still be ``expected`` (a run's model section, made from it)."""
    model, cfg = load(path, dtype=expected.dtype)
    if cfg != expected:
        raise UnsupportedCheckpoint(f"{path}: its config.json no longer matches the run's "
                                    "model section (was the checkpoint replaced?)")
    return nnx.split(model, nnx.Param, ...)[1]


# --------------------------------------------------------------------------------------------
# Out: the GPT's parameters under Hugging Face's names (experiments.export)


def architecture(cfg: GPTConfig) -> str:
    """The Hugging Face architecture a GPT config is (model_type): ``qwen3`` with q/k norms,
    ``qwen2`` with q/k/v biases, ``mistral`` with a sliding window, else ``llama``. Raises
    :class:`UnsupportedCheckpoint` for a GPT no Llama-family model expresses (the GELU MLP,
    learned positions, experts)."""
    bad = []
    if cfg.mlp != "dense" or cfg.mlp_act != "swiglu":
        bad.append(f"mlp={cfg.mlp!r}, mlp_act={cfg.mlp_act!r} (the family's MLP is a dense "
                   "SwiGLU: model.mlp_act='swiglu')")
    if cfg.positions != "rope":
        bad.append(f"positions={cfg.positions!r} (the family uses RoPE)")
    if cfg.qk_norm and cfg.qkv_bias:
        bad.append("both q/k norms and q/k/v biases")
    if cfg.sliding_window and (cfg.qk_norm or cfg.qkv_bias):
        bad.append("a sliding window with q/k norms or biases")
    if bad:
        raise UnsupportedCheckpoint(f"this GPT has no Llama-family equivalent: {'; '.join(bad)}")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def hf_config(cfg: GPTConfig) -> dict:
    """The Hugging Face ``config.json`` (a dict) of a GPT of the Llama family, in
    transformers 4's keys (``rope_theta``, ``rope_scaling``), which transformers 5 still
    reads."""
    arch = architecture(cfg)
    out = {
        "architectures": [next(a for a, t in ARCHITECTURES.items() if t == arch)],
        "model_type": arch,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias if arch == "qwen2" else False,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                               "low_freq_factor": cfg.rope_low_freq,
                               "high_freq_factor": cfg.rope_high_freq,
                               "original_max_position_embeddings": cfg.rope_original_len}
    if arch == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out


def _hf_rows(x):
    """A GPT kernel ``[in, out]`` as Hugging Face's ``[out, in]`` weight: a QArray's view
    (:func:`lowbit.io.views.as_rows`, the same codes), a float array's transpose."""
    return as_rows(x) if is_qarray(x) else np.asarray(x).T


def _rows(x, lo: int, hi: int):
    return take_rows(x, np.arange(lo, hi)) if is_qarray(x) else x[lo:hi]


def to_hf(cfg: GPTConfig, params) -> dict:
    """The GPT's parameters (an ``nnx.State`` of its Params, float or packed by
    :func:`lowbit.flax.pack`) under Hugging Face's names and ``[out, in]`` layout: the inverse
    of :func:`load`'s mapping (the fused q/k/v kernel split into ``q_proj`` / ``k_proj`` /
    ``v_proj``; a packed kernel's codes and scales kept, its tensor scale shared by the three).
    Float tensors are NumPy float32 arrays, packed ones :class:`lowbit.QArray` s quantized
    along their last axis."""
    architecture(cfg)
    flat = {tuple(k): v for k, v in nnx.to_flat_state(params)}

    def get(*key):
        v = flat[key]
        v = v.get_value() if hasattr(v, "get_value") else v
        return v if is_qarray(v) else np.asarray(v, np.float32)

    q, kv = cfg.heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": get("embed", "embedding"),
           "model.norm.weight": get("norm_f", "scale")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _hf_rows(get("head", "kernel"))
    for i in range(cfg.layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = get(*b, "norm1", "scale")
        out[p + "post_attention_layernorm.weight"] = get(*b, "norm2", "scale")
        qkv = _hf_rows(get(*b, "attn", "qkv", "kernel"))
        for n, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
            out[f"{a}{n}_proj.weight"] = _rows(qkv, lo, hi)
            if cfg.qkv_bias:
                out[f"{a}{n}_proj.bias"] = get(*b, "attn", "qkv", "bias")[lo:hi]
        out[a + "o_proj.weight"] = _hf_rows(get(*b, "attn", "out", "kernel"))
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = get(*b, "attn", "q_norm", "scale")
            out[a + "k_norm.weight"] = get(*b, "attn", "k_norm", "scale")
        for n in ("gate", "up", "down"):
            out[f"{p}mlp.{n}_proj.weight"] = _hf_rows(get(*b, "mlp", n, "kernel"))
    return out


_SITES = {"self_attn.q_proj": "attn/qkv", "self_attn.k_proj": "attn/qkv",
          "self_attn.v_proj": "attn/qkv", "self_attn.o_proj": "attn/out",
          "mlp.gate_proj": "mlp/gate", "mlp.up_proj": "mlp/up", "mlp.down_proj": "mlp/down"}


def site_of(module: str) -> str:
    """The GPT site (``lowbit.flax`` path) that computes a Hugging Face linear module:
    ``model.layers.3.self_attn.k_proj`` -> ``blocks/3/attn/qkv``, ``lm_head`` -> ``head``.

    >>> site_of("model.layers.3.self_attn.k_proj"), site_of("lm_head")
    ('blocks/3/attn/qkv', 'head')
    """
    if module == "lm_head":
        return "head"
    _, _, i, rest = module.split(".", 3)
    return f"blocks/{i}/{_SITES[rest]}"
