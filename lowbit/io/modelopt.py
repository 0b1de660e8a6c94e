"""Hugging Face checkpoints in NVIDIA ModelOpt's unified export layout (what TensorRT-LLM,
vLLM and SGLang load as ``quant_method: "modelopt"``): NVFP4 and MXFP8 weights, float weights
for the modules left unquantized.

ModelOpt's NVFP4 value is ``code * weight_scale * weight_scale_2``, lowbit's
``(code * s) * t``: the same numbers in the same roles, so a QArray's codes, block-scale bytes
and float32 tensor scale are written unchanged (moved into the ``[out, in]`` layout by
:func:`lowbit.io.safetensors.linear_codes`, never requantized), whatever the tensor scale.
ModelOpt's own torch dequantizer forms ``weight_scale * weight_scale_2`` first
(``nvfp4_tensor.py:390-406``), which for a tensor scale that is not a power of two can differ
from lowbit's order in the last bit; the GEMM kernels apply the per-tensor factor to the
accumulator instead.

Conventions, from NVIDIA/Model-Optimizer @ a2fbac7b (``modelopt/torch/``):

- Tensors of a quantized module ``m`` (``export/unified_export_hf.py:663-709``):
  ``m.weight``, ``m.weight_scale``, ``m.weight_scale_2`` (NVFP4, ``.squeeze()``d to a 0-d
  float32), ``m.input_scale`` (NVFP4 with a calibrated input quantizer, 0-d float32).
- NVFP4 ``weight``: uint8 ``[out, in / 2]``, ``(q[..., 1::2] << 4) | q[..., 0::2]``
  (``quantization/qtensor/nvfp4_tensor.py:336-337``): the even column in the low nibble, as
  lowbit packs; E2M1 codes sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (``:27``).
  ``weight_scale``: float8_e4m3fn ``[out, in / 16]`` (``:169-202``), lowbit's unsigned-E4M3
  bytes. ``weight_scale_2 = amax / (6 * 448)`` (``:88-108``, ``:204-207``), lowbit's
  ``tensor_scale`` itself. ``input_scale = amax / (6 * 448)`` of the activations
  (``:209-227``; ``export/quant_utils.py:245-260``), lowbit's activation tensor scale
  (``lowbit.core.scales.nvfp4_tensor_scale``, the same float32 division).
- MXFP8 ``weight``: float8_e4m3fn ``[out, in]``, ``weight_scale``: uint8 biased exponents
  ``[out, in / 32]``, value ``weight * 2 ** (weight_scale - 127)``
  (``quantization/qtensor/mxfp8_tensor.py:39-40, 92-94, 144-190, 227-262``;
  ``export/quant_utils.py:871-872``): lowbit's E4M3 codes and E8M0 bytes. Activations are
  quantized dynamically: no ``input_scale``.
- ``hf_quant_config.json`` (``export/quant_utils.py:1583-1705``, written by
  ``export/unified_export_hf.py:1460-1488``): ``{"producer": {"name", "version"},
  "quantization": {"quant_algo", "kv_cache_quant_algo", ...}}`` with, for one format,
  ``quant_algo`` ``"NVFP4"`` (``input_scale`` present), ``"W4A16_NVFP4"`` (weights only) or
  ``"MXFP8"``, its ``group_size`` (16, 32) and ``exclude_modules``; for several,
  ``"MIXED_PRECISION"`` and ``quantized_layers`` {module: {"quant_algo", "group_size"}}
  and no ``exclude_modules`` (``export/quant_utils.py:680-789``). ModelOpt summarises
  ``exclude_modules`` with prefix wildcards (``:606-677``); this module lists the names.
- ``config.json``'s ``quantization_config`` is ``convert_hf_quant_config_format`` of it
  (``export/convert_hf_config.py:130-282``, per-layer groups ``:23-127``):
  ``quant_method`` ``"modelopt"``, ``quant_algo``, ``ignore`` (the excluded modules),
  ``producer``, and ``config_groups`` for NVFP4, W4A16_NVFP4 and MIXED_PRECISION (with
  ``quantized_layers``); a single MXFP8 format gets none, as there.

Weights come as in :mod:`lowbit.io.compressed_tensors`: ``{HF module name: QArray or float
array}`` in lowbit's ``[K_in, N_out]`` orientation quantized along axis 0 (``layout="lowbit"``)
or ``[N_out, K_in]`` along axis 1 (``layout="hf"``).

>>> import jax, numpy as np, lowbit as lb
>>> w = jax.random.normal(jax.random.key(0), (64, 32))   # [K_in, N_out]
>>> tensors, hf_quant, _ = modelopt_state({"model.layers.0.mlp.down_proj": lb.quantize(
...     w, "nvfp4", axis=0)}, activation_amax={"model.layers.0.mlp.down_proj": 4.0})
>>> hf_quant["quantization"]["quant_algo"], tensors["model.layers.0.mlp.down_proj.input_scale"]
('NVFP4', np.float32(0.0014880953))
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from lowbit.core.qarray import QArray
from lowbit.io.safetensors import engine_tensors, linear_codes, write_hf_directory

__all__ = ["write_modelopt", "modelopt_state", "FORMATS", "HF_QUANT_CONFIG"]

ENGINE = "ModelOpt"
HF_QUANT_CONFIG = "hf_quant_config.json"
# lowbit format -> quantization group along the input axis
FORMATS = {"nvfp4": 16, "mxfp8_e4m3": 32}
_FP4_FP8_MAX = np.float32(6.0 * 448.0)  # E2M1_MAX * E4M3_MAX


def _version() -> str:
    try:
        return importlib.metadata.version("lowbit")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "unknown"


def _quantized(module: str, q: QArray, layout: str, amax) -> tuple[dict, str]:
    """(tensors of one quantized module, its quant_algo)."""
    if q.format_name not in FORMATS:
        raise ValueError(f"{ENGINE}: module {module!r} is {q.format_name}; {ENGINE}'s export "
                         f"holds {', '.join(FORMATS)} here (quant_algo NVFP4 / W4A16_NVFP4, "
                         "MXFP8)")
    fmt = q.format_name
    codes, scales = linear_codes(module, q, layout=layout, group=FORMATS[fmt], engine=ENGINE)
    if fmt == "mxfp8_e4m3":
        if amax is not None:
            raise ValueError(f"{ENGINE}: module {module!r} is MXFP8, whose activations are "
                             "scaled dynamically: no input_scale (drop its activation_amax)")
        return {f"{module}.weight": codes.view(ml_dtypes.float8_e4m3fn),
                f"{module}.weight_scale": scales}, "MXFP8"
    t = np.float32(np.asarray(jax.device_get(q.tensor_scale)))
    if t.shape != () or not np.isfinite(t):
        raise ValueError(f"{ENGINE}: module {module!r}: weight_scale_2 is one finite float32, "
                         f"got the tensor scale {t!r}")
    out = {f"{module}.weight": codes,
           f"{module}.weight_scale": scales.view(ml_dtypes.float8_e4m3fn),
           f"{module}.weight_scale_2": t}
    if amax is None:
        return out, "W4A16_NVFP4"
    a = np.float32(np.asarray(jax.device_get(amax)))
    if a.shape != () or not (np.isfinite(a) and a > 0):
        raise ValueError(f"{ENGINE}: module {module!r}: activation amax {a!r} must be one "
                         "finite positive number")
    out[f"{module}.input_scale"] = a / _FP4_FP8_MAX
    return out, "NVFP4"


def _group_config(algo: str, group_size: int) -> dict:
    """``_quant_algo_to_group_config`` (convert_hf_config.py:23-127) for lowbit's algos."""
    weights = {"dynamic": False, "num_bits": 4 if "NVFP4" in algo else 8, "type": "float",
               "group_size": group_size}
    if algo == "W4A16_NVFP4":
        return {"weights": weights}
    return {"input_activations": {**weights}, "weights": weights}


def _quantization_config(quant: dict, producer: dict) -> dict:
    """``convert_hf_quant_config_format`` (convert_hf_config.py:130-282) of lowbit's
    ``hf_quant_config["quantization"]``."""
    algo = quant["quant_algo"]
    out: dict[str, Any] = {}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        out["config_groups"] = {"group_0": {**_group_config(algo, quant["group_size"]),
                                            "targets": ["Linear"]}}
    elif algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = {}
        for layer, cfg in quant["quantized_layers"].items():
            by_cfg.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        out["config_groups"] = {
            f"group_{i}": {**_group_config(dict(k)["quant_algo"], dict(k)["group_size"]),
                           "targets": sorted(layers)}
            for i, (k, layers) in enumerate(by_cfg.items())
        }
        out["quantized_layers"] = quant["quantized_layers"]
    out["ignore"] = quant.get("exclude_modules", [])
    out["quant_algo"] = algo
    out["producer"] = producer
    out["quant_method"] = "modelopt"
    return out


def modelopt_state(
    weights: Mapping[str, Any],
    tensors: Mapping[str, Any] | None = None,
    *,
    layout: str = "lowbit",
    activation_amax: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
    producer: Mapping[str, str] | None = None,
) -> tuple[dict[str, np.ndarray], dict, dict]:
    """The tensors, ``hf_quant_config.json`` and ``quantization_config`` of a ModelOpt
    checkpoint.

    Args:
      weights: linear module name -> QArray (nvfp4 or mxfp8_e4m3, blocks along the input
        axis) or float array (written as ``<name>.weight``, listed in ``exclude_modules``).
      tensors: every other tensor by its Hugging Face name, written as given.
      layout: ``"lowbit"`` (weights ``[K_in, N_out]``) or ``"hf"`` (``[N_out, K_in]``).
      activation_amax: module -> calibrated activation amax of an NVFP4 module: its
        ``input_scale`` (quant_algo NVFP4); NVFP4 modules without one are W4A16_NVFP4.
      exclude: more module names to list as unquantized (e.g. ``"lm_head"``).
      producer: ``hf_quant_config``'s producer (default ``{"name": "lowbit", "version":
        lowbit's}``).

    Returns ``(tensors, hf_quant_config, quantization_config)``.
    """
    out, algos, floats = engine_tensors(
        ENGINE, weights, tensors, activation_amax, layout,
        lambda module, w, amax: _quantized(module, w, layout, amax))
    layers = {m: {"quant_algo": algo, "group_size": FORMATS[weights[m].format_name]}
              for m, algo in algos.items()}
    quant: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    kinds = {tuple(sorted(c.items())) for c in layers.values()}
    if len(kinds) > 1:
        quant.update(quant_algo="MIXED_PRECISION", quantized_layers=layers)
    else:
        quant.update(next(iter(layers.values())))
        quant["exclude_modules"] = sorted({*floats, *exclude})
    producer = dict(producer or {"name": "lowbit", "version": _version()})
    hf_quant = {"producer": producer, "quantization": quant}
    return out, hf_quant, _quantization_config(quant, producer)


def write_modelopt(
    path: str | os.PathLike,
    weights: Mapping[str, Any],
    tensors: Mapping[str, Any] | None = None,
    *,
    config: Mapping[str, Any],
    layout: str = "lowbit",
    activation_amax: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
    producer: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
) -> pathlib.Path:
    """Write a Hugging Face model directory in ModelOpt's layout: ``hf_quant_config.json``,
    ``config.json`` (``config``, the model's Hugging Face config, plus the
    ``quantization_config``, which replaces any there) and ``model.safetensors`` (sharded with
    ``max_shard_size``). Other arguments as in :func:`modelopt_state`. Returns ``path``."""
    out, hf_quant, qc = modelopt_state(weights, tensors, layout=layout,
                                       activation_amax=activation_amax, exclude=exclude,
                                       producer=producer)
    files = {HF_QUANT_CONFIG: hf_quant, "config.json": {**dict(config), "quantization_config": qc}}
    return write_hf_directory(path, out, files, max_shard_size=max_shard_size)
