"""Hugging Face checkpoints in compressed-tensors' packed formats, as vLLM and transformers
load them: ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``, ``mxfp8-quantized``, and float
weights for the modules left unquantized.

What is written is what lowbit evaluated: a QArray's codes and scale bytes are moved into the
engine's layout (:func:`lowbit.io.safetensors.linear_codes`), never requantized; where a
lowbit value has no exact counterpart in the engine's convention, a ValueError names the
module, the engine and the reason.

Conventions, from vllm-project/compressed-tensors @ ac8e2ba8 (``src/compressed_tensors/``;
checked against the pip release 0.20.1 by ``tests/test_interop_compressed_tensors.py``):

- Tensors of a quantized module ``m``: ``m.weight_packed``, ``m.weight_scale``,
  ``m.weight_global_scale`` (NVFP4), ``m.input_global_scale`` (NVFP4 with static activation
  scales) -- ``compressors/nvfp4/base.py:36-46``; MXFP4 drops the global scales
  (``compressors/mxfp4/base.py:35-43``); MXFP8 stores ``m.weight`` and ``m.weight_scale``
  (``compressors/naive_quantized/base.py:37-46``, subclassed by ``compressors/mxfp8/base.py:29``).
- ``weight_packed`` is uint8 ``[out_features, in_features / 2]``: E2M1 codes (sign bit 3,
  magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), the even column in the low nibble --
  ``compressors/nvfp4/helpers.py:20-22, 142-156`` (pack) and ``178-193`` (unpack): lowbit's
  own FP4 packing, byte for byte.
- ``weight_scale``: NVFP4 float8_e4m3fn ``[out, in / 16]`` (``nvfp4/base.py:49-53``, group
  16 at ``131-139``) -- lowbit's unsigned-E4M3 bytes; MXFP4 / MXFP8 uint8 biased exponents,
  ``2 ** (e - 127)`` (``compressors/mx_utils.py:18-44``, group 32 at ``mxfp4/base.py:57-65``,
  ``mxfp8/base.py:95-104``) -- lowbit's E8M0 bytes.
- Dequantization is ``code * (weight_scale / weight_global_scale)``
  (``quantization/lifecycle/forward_helpers.py:549-572``, called from
  ``nvfp4/base.py:95-128``), so the global scale is the reciprocal of lowbit's tensor scale:
  lowbit's value is ``(code * s) * t``, compressed-tensors' ``code * (s / g)``. This module
  writes ``g = float32(1 / t)`` (float32, shape ``[1]``, as ``quantization/lifecycle/
  initialize.py:187-192`` creates it; the ModelOpt converter ``entrypoints/convert/
  converters/modelopt_nvfp4.py:69-75`` makes the same ``1 / x``) and checks, for every
  (element, block scale) pair the weight holds, that both products agree in float32. They
  do whenever ``t`` is a power of two; quantize with ``tensor_amax=exact_tensor_amax(amax)``
  to get one. A NaN / Inf block is refused (the E8M0 NaN code would decode as ``2 ** 128``
  there).
- ``input_global_scale = 448 * 6 / amax`` in float32 (``quantization/utils/helpers.py:
  308-337``, ``generate_gparam``): activations are quantized by the engine at run time, its
  block scales computed from this global scale (dynamic ``"local"``).
- ``config.json``'s ``quantization_config``: ``quant_method`` ``"compressed-tensors"``,
  ``format`` (one of the above, or ``"mixed-precision"`` for several --
  ``compressors/format.py:99-114``), ``quantization_status`` ``"compressed"``,
  ``config_groups`` of QuantizationSchemes (``targets``, ``weights``,
  ``input_activations``, ``format``) as the presets NVFP4A16 / NVFP4 / MXFP4A16 / MXFP4 /
  MXFP8A16 / MXFP8 spell them (``quantization/quant_scheme.py:166-274``), and ``ignore``
  (``quantization/quant_config.py:157-166``; the surrounding keys as
  ``compressors/model_compressors/model_compressor.py:225-244`` writes them). Targets are
  the exact module names (``utils/match.py:422-446``: a target without ``re:`` matches the
  name itself), so only the modules given are quantized; the float modules are listed in
  ``ignore``. Every linear layer of the model must be one or the other (or in ``ignore=``):
  vLLM's ``find_matched_target`` raises "Unable to find matching target" for a linear layer
  that is neither targeted nor ignored.

transformers (5.25) loads these directories as they are (compressed; the first forward
decompresses each module with its own scheme). Its ``dequantize=True`` path decompresses every
dense module with one scheme, the first config group's (``integrations/compressed_tensors.py:
45-52, 90-92``), so it fails on a mixed NVFP4 / MXFP4 directory; load those compressed.

Weights come as ``{module name: QArray or float array}`` with HF dotted names
(``"model.layers.0.mlp.down_proj"``), in lowbit's ``[K_in, N_out]`` orientation quantized along
axis 0 (``layout="lowbit"``, the default: its codes are already stored ``[N, K / 2]``) or in
Hugging Face's ``[N_out, K_in]`` quantized along axis 1 (``layout="hf"``); 2-D tiles (NVIDIA's
16x16 weight blocks) are written with their scale repeated over the rows and groups they cover.

>>> import jax, jax.numpy as jnp, lowbit as lb
>>> w = jax.random.normal(jax.random.key(0), (64, 32))   # [K_in, N_out]
>>> q = lb.quantize(w, "nvfp4", axis=0, tensor_amax=exact_tensor_amax(jnp.abs(w).max()))
>>> tensors, qc = compressed_tensors_state({"model.layers.0.mlp.down_proj": q})
>>> tensors["model.layers.0.mlp.down_proj.weight_packed"].shape, qc["format"]
((32, 32), 'nvfp4-pack-quantized')
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from lowbit.core.qarray import QArray
from lowbit.core.scales import pow2_tensor_amax
from lowbit.io.safetensors import engine_tensors, linear_codes, write_hf_directory

__all__ = [
    "write_compressed_tensors",
    "compressed_tensors_state",
    "exact_tensor_amax",
    "FORMATS",
]

ENGINE = "compressed-tensors"
# lowbit format -> (compressed-tensors format, quantization group along the input axis)
FORMATS = {
    "nvfp4": ("nvfp4-pack-quantized", 16),
    "mxfp4": ("mxfp4-pack-quantized", 32),
    "mxfp8_e4m3": ("mxfp8-quantized", 32),
}
_FP4_FP8_MAX = np.float32(448.0 * 6.0)  # generate_gparam's scale_data.max * quant_data.max
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def exact_tensor_amax(amax) -> np.float32:
    """The smallest ``2688 * 2**k`` at or above ``amax``
    (:func:`lowbit.core.scales.pow2_tensor_amax`): NVFP4 quantized with it as ``tensor_amax``
    has the tensor scale ``2**k``, whose reciprocal compressed-tensors' global scale holds
    exactly. A recipe whose specs set ``pow2_tensor_scale`` (``qat_nvfp4_pow2``,
    ``w4a16_nvfp4_pow2``) quantizes so on every call.

    >>> float(exact_tensor_amax(3000.0)), float(exact_tensor_amax(2688.0))
    (5376.0, 2688.0)
    """
    a = float(np.asarray(jax.device_get(amax), np.float64))
    if not np.isfinite(a) or a <= 0:
        raise ValueError(f"amax must be finite and positive, got {a}")
    out = np.float32(pow2_tensor_amax(np.float32(a)))
    if not np.isfinite(out) or out < a or float(out) / float(_FP4_FP8_MAX) < 2.0**-126:
        raise ValueError(f"amax={a} has no power-of-two tensor scale in float32's normal range")
    return out


def _weight_args(fmt: str) -> dict:
    """The ``weights`` QuantizationArgs of the presets (quant_scheme.py:166-177, 204-215,
    240-251)."""
    if fmt == "nvfp4":
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                "strategy": "tensor_group", "dynamic": False,
                "scale_dtype": "torch.float8_e4m3fn"}
    bits = 4 if fmt == "mxfp4" else 8
    return {"num_bits": bits, "type": "float", "symmetric": True, "group_size": 32,
            "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}


def _activation_args(fmt: str) -> dict:
    """The ``input_activations`` of the presets NVFP4 (static global scale, block scales
    ``"local"``ly dynamic; quant_scheme.py:191-201) and MXFP4 / MXFP8 (dynamic; 228-237,
    264-273)."""
    if fmt == "nvfp4":
        return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                "strategy": "tensor_group", "dynamic": "local",
                "scale_dtype": "torch.float8_e4m3fn", "observer": "static_minmax"}
    bits = 4 if fmt == "mxfp4" else 8
    return {"num_bits": bits, "type": "float", "symmetric": True, "group_size": 32,
            "strategy": "group", "dynamic": True, "scale_dtype": "torch.uint8"}


def _global_scale(module: str, t, packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """compressed-tensors' ``weight_global_scale`` of lowbit's tensor scale ``t``: ``[1/t]``
    in float32, checked to reproduce lowbit's value of every (element, block scale) pair
    present; a ValueError saying why not."""
    t = np.float32(np.asarray(jax.device_get(t)))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        g = np.float32(1.0) / t
    where = f"{ENGINE}: module {module!r}"
    if not (np.isfinite(t) and t > 0 and np.isfinite(g)):
        raise ValueError(f"{where}: the tensor scale {float(t)!r} has no finite positive "
                         "reciprocal for nvfp4-pack-quantized's weight_global_scale")
    mags = np.stack([packed & 0x7, (packed >> 4) & 0x7], axis=-1).reshape(packed.shape[0], -1)
    key = mags.astype(np.uint16) * 256 + np.repeat(scales, 16, axis=1).astype(np.uint16)
    present = np.flatnonzero(np.bincount(key.ravel(), minlength=8 * 256))
    x = _E2M1[present // 256]
    s = (present % 256).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    theirs = x * (s / g)  # forward_helpers.py:559-567, in float32
    ours = (x * s) * t  # lowbit.core.qarray.dequantize
    bad = np.flatnonzero(theirs != ours)
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"{where}: nvfp4-pack-quantized dequantizes code * (block_scale / "
            f"weight_global_scale) with weight_global_scale = 1 / tensor_scale; lowbit's "
            f"tensor scale {float(t)!r} has the inexact reciprocal {float(g)!r}, so element "
            f"{float(x[i])} with block scale {float(s[i])} comes out {float(theirs[i])!r} "
            f"there and {float(ours[i])!r} in lowbit "
            f"({bad.size} of {present.size} (element, scale) pairs differ). A power-of-two "
            "tensor scale is exact: quantize with tensor_amax=exact_tensor_amax(amax), or train "
            "and pack with a pow2_tensor_scale recipe (qat_nvfp4_pow2, w4a16_nvfp4_pow2).")
    return np.reshape(g, (1,))


def _quantized(module: str, q: QArray, layout: str, amax, mx_act: bool):
    """(tensors of one quantized module, its scheme key)."""
    if q.format_name not in FORMATS:
        raise ValueError(f"{ENGINE}: module {module!r} is {q.format_name}; {ENGINE} holds "
                         f"{', '.join(FORMATS)} (formats {[f for f, _ in FORMATS.values()]})")
    fmt = q.format_name
    packed, scales = linear_codes(module, q, layout=layout, group=FORMATS[fmt][1],
                                  engine=ENGINE)
    out: dict[str, np.ndarray] = {}
    if fmt == "mxfp8_e4m3":
        out[f"{module}.weight"] = packed.view(ml_dtypes.float8_e4m3fn)
        out[f"{module}.weight_scale"] = scales
    else:
        out[f"{module}.weight_packed"] = packed
        out[f"{module}.weight_scale"] = (scales.view(ml_dtypes.float8_e4m3fn)
                                         if fmt == "nvfp4" else scales)
    if fmt == "nvfp4":
        out[f"{module}.weight_global_scale"] = _global_scale(module, q.tensor_scale, packed,
                                                             scales)
    if amax is not None:
        if fmt != "nvfp4":
            raise ValueError(f"{ENGINE}: module {module!r} is {fmt}, whose activations are "
                             "scaled dynamically (no input_global_scale); activation_amax is "
                             "for NVFP4 modules (mx_activations=True quantizes MX activations)")
        a = np.float32(np.asarray(jax.device_get(amax)))
        if not (np.isfinite(a) and a > 0):
            raise ValueError(f"{ENGINE}: module {module!r}: activation amax {float(a)!r} must be "
                             "finite and positive")
        out[f"{module}.input_global_scale"] = np.reshape(_FP4_FP8_MAX / a, (1,))
    acts = amax is not None or (mx_act and fmt != "nvfp4")
    return out, (fmt, acts)


def compressed_tensors_state(
    weights: Mapping[str, Any],
    tensors: Mapping[str, Any] | None = None,
    *,
    layout: str = "lowbit",
    activation_amax: Mapping[str, Any] | None = None,
    mx_activations: bool = False,
    ignore: Iterable[str] = (),
) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors and the ``quantization_config`` of a compressed-tensors checkpoint.

    Args:
      weights: linear module name -> QArray (nvfp4, mxfp4 or mxfp8_e4m3, blocks along the
        input axis) or float array (written as ``<name>.weight``, listed in ``ignore``).
      tensors: every other tensor by its Hugging Face name (norms, embeddings, biases),
        written as given.
      layout: ``"lowbit"`` (weights ``[K_in, N_out]``) or ``"hf"`` (``[N_out, K_in]``).
      activation_amax: module -> calibrated activation amax, for NVFP4 modules whose inputs
        the engine quantizes too (the preset NVFP4: ``input_global_scale``); other NVFP4
        modules get the weight-only preset NVFP4A16.
      mx_activations: MXFP4 / MXFP8 modules quantize their inputs dynamically (presets MXFP4,
        MXFP8) instead of keeping them in 16 bits (MXFP4A16, MXFP8A16).
      ignore: more module names the engine leaves unquantized (e.g. ``"lm_head"``).

    Returns ``(tensors, quantization_config)``; see the module docstring for both.
    """
    out, keys, floats = engine_tensors(
        ENGINE, weights, tensors, activation_amax, layout,
        lambda module, w, amax: _quantized(module, w, layout, amax, mx_activations))
    groups: dict[tuple[str, bool], list[str]] = {}
    for module, key in keys.items():
        groups.setdefault(key, []).append(module)
    config_groups = {}
    for i, ((fmt, acts), modules) in enumerate(groups.items()):
        config_groups[f"group_{i}"] = {
            "targets": modules,
            "weights": _weight_args(fmt),
            "input_activations": _activation_args(fmt) if acts else None,
            "output_activations": None,
            "format": FORMATS[fmt][0],
        }
    formats = {FORMATS[fmt][0] for fmt, _ in groups}
    qc = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [*floats, *(m for m in ignore if m not in floats)],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
    return out, qc


def write_compressed_tensors(
    path: str | os.PathLike,
    weights: Mapping[str, Any],
    tensors: Mapping[str, Any] | None = None,
    *,
    config: Mapping[str, Any],
    layout: str = "lowbit",
    activation_amax: Mapping[str, Any] | None = None,
    mx_activations: bool = False,
    ignore: Iterable[str] = (),
    max_shard_size: int | str | None = None,
) -> pathlib.Path:
    """Write a Hugging Face model directory in compressed-tensors' formats: ``config.json``
    (``config``, the model's Hugging Face config, plus the ``quantization_config``, which
    replaces any there) and ``model.safetensors`` (sharded with ``max_shard_size``, as
    :func:`lowbit.io.safetensors.write_safetensors` does). Other arguments as in
    :func:`compressed_tensors_state`. Returns ``path``."""
    out, qc = compressed_tensors_state(weights, tensors, layout=layout,
                                       activation_amax=activation_amax,
                                       mx_activations=mx_activations, ignore=ignore)
    cfg = {**dict(config), "quantization_config": qc}
    return write_hf_directory(path, out, {"config.json": cfg}, max_shard_size=max_shard_size)
