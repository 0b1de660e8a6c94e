"""compressed-tensors' and transformers' own readers load what lowbit.io writes, and recover
lowbit's dequantized weights bit for bit: compressed-tensors' model-free dequantizer
(``CompressedTensorsDequantizer``, each format's compressor ``decompress``), a tiny Llama
loaded by ``transformers.AutoModelForCausalLM``, and the ModelOpt NVFP4 layout through
compressed-tensors' own ``ModelOptNvfp4Converter`` (the one pip-installable reader of that
layout; ModelOpt's MXFP8 is checked only by the independent decoder of
``tests/test_io_export_formats.py``).

Run with ``make test-interop`` (installs torch==2.13.0 CPU, transformers, compressed-tensors);
skipped, with the reason, where those are missing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.io.compressed_tensors import (
    compressed_tensors_state,
    exact_tensor_amax,
    write_compressed_tensors,
)
from lowbit.io.modelopt import modelopt_state

pytestmark = pytest.mark.interop

torch = pytest.importorskip("torch", reason="interop: needs torch (make test-interop)")
ct = pytest.importorskip("compressed_tensors",
                         reason="interop: needs compressed-tensors (make test-interop)")
pytest.importorskip("transformers", reason="interop: needs transformers (make test-interop)")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.format import infer_module_format  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (  # noqa: E402
    ModelOptNvfp4Converter,
)
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _w(i: int, shape):
    return jax.random.normal(jax.random.fold_in(jax.random.key(3), i), shape) * 0.2


def _nvfp4(w, **kw):
    return lb.quantize(w, "nvfp4", axis=kw.pop("axis", 0),
                       tensor_amax=exact_tensor_amax(jnp.abs(w).max()), **kw)


def _lowbit(q, dtype=jnp.float32) -> np.ndarray:
    """lowbit's value of a [K, N] weight in the [N, K] layout, float32 bits."""
    return np.asarray(lb.dequantize(q, dtype).astype(jnp.float32)).T.view(np.uint32)


def _torch(arrays: dict) -> dict:
    """numpy arrays (FP8 as ml_dtypes) -> torch tensors of the same dtype and bytes."""
    out = {}
    for k, v in arrays.items():
        v = np.array(v)  # a writable copy
        if v.dtype.name == "float8_e4m3fn":
            out[k] = torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            out[k] = torch.from_numpy(v)
    return out


def _theirs(t) -> np.ndarray:
    return t.detach().to(torch.float32).numpy().view(np.uint32)


WEIGHTS = {
    "model.layers.0.self_attn.q_proj": lambda: _nvfp4(_w(0, (64, 64))),
    "model.layers.0.self_attn.k_proj": lambda: _nvfp4(_w(1, (64, 64)), axis=(1, 0),
                                                      block_shape=(16, 16)),
    "model.layers.0.self_attn.v_proj": lambda: _nvfp4(_w(2, (64, 64))),
    "model.layers.0.self_attn.o_proj": lambda: lb.quantize(_w(3, (64, 64)), "mxfp4", axis=0),
    "model.layers.0.mlp.gate_proj": lambda: _nvfp4(_w(4, (64, 128))),
    "model.layers.0.mlp.up_proj": lambda: _nvfp4(_w(5, (64, 128))),
    "model.layers.0.mlp.down_proj": lambda: lb.quantize(_w(6, (128, 64)), "mxfp4", axis=0),
}


def test_compressed_tensors_dequantizer_recovers_lowbits_weights(tmp_path):
    weights = {
        "a": _nvfp4(_w(0, (64, 48))),
        "b": _nvfp4(_w(1, (64, 48)), axis=(1, 0), block_shape=(16, 16)),
        "c": lb.quantize(_w(2, (64, 48)), "mxfp4", axis=0),
        "d": lb.quantize(_w(3, (64, 48)), "mxfp8", axis=0),
        "e": _w(4, (64, 48)),
    }
    write_compressed_tensors(tmp_path, weights, config={"model_type": "llama"},
                             activation_amax={"a": 4.0})
    deq = CompressedTensorsDequantizer(tmp_path, dtype=torch.float32)
    for scheme in deq.quant_config.config_groups.values():  # our args pick our compressor
        assert infer_module_format(torch.nn.Linear, scheme) == scheme.format
    tensors = load_file(tmp_path / "model.safetensors")
    out = deq.process(dict(tensors))
    for m in "abcd":
        np.testing.assert_array_equal(_theirs(out[f"{m}.weight"]), _lowbit(weights[m]), err_msg=m)
    assert out["a.input_global_scale"].item() == np.float32(2688.0) / np.float32(4.0)


def test_each_compressor_decompresses_its_module(tmp_path):
    weights = {"n": _nvfp4(_w(0, (64, 32))), "x": lb.quantize(_w(1, (64, 32)), "mxfp4", axis=0),
               "f8": lb.quantize(_w(2, (64, 32)), "mxfp8", axis=0)}
    arrays, qc = compressed_tensors_state(weights)
    config = QuantizationConfig.model_validate(qc)
    assert config.format == "mixed-precision"
    tensors = _torch(arrays)
    for scheme in config.config_groups.values():
        (module,) = scheme.targets
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        names = compressor.compression_param_names(scheme)
        state = compressor.decompress({n: tensors[f"{module}.{n}"] for n in names}, scheme)
        np.testing.assert_array_equal(_theirs(state["weight"]), _lowbit(weights[module]))


def test_transformers_loads_a_tiny_llama(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                      max_position_embeddings=32, tie_word_embeddings=False)
    weights = {name: make() for name, make in WEIGHTS.items()}
    weights["lm_head"] = _w(9, (64, 64)).astype(jnp.bfloat16)
    ones = np.ones(64, np.float32)
    others = {"model.embed_tokens.weight": np.asarray(_w(8, (64, 64))),
              "model.norm.weight": ones, "model.layers.0.input_layernorm.weight": ones,
              "model.layers.0.post_attention_layernorm.weight": ones}
    write_compressed_tensors(tmp_path, weights, others, config=cfg.to_dict())
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    logits = model(torch.tensor([[1, 2, 3]])).logits  # the first forward decompresses
    assert logits.shape == (1, 3, 64) and bool(torch.isfinite(logits).all())
    params = dict(model.named_parameters())
    for name, q in weights.items():
        if isinstance(q, lb.QArray):  # bfloat16 holds these values exactly
            np.testing.assert_array_equal(_theirs(params[f"{name}.weight"]), _lowbit(q),
                                          err_msg=name)
            np.testing.assert_array_equal(_theirs(params[f"{name}.weight"]),
                                          _lowbit(q, jnp.bfloat16), err_msg=name)
    head = np.asarray(weights["lm_head"]).T.view(np.uint16)
    np.testing.assert_array_equal(params["lm_head.weight"].detach().view(torch.int16).numpy()
                                  .view(np.uint16), head)


def test_modelopt_nvfp4_layout_through_compressed_tensors_converter():
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    weights = {"model.layers.0.mlp.up_proj": _nvfp4(_w(0, (64, 32))),
               "model.layers.0.mlp.down_proj": _nvfp4(_w(1, (32, 64)), axis=(1, 0),
                                                      block_shape=(16, 16)),
               "lm_head": _w(2, (64, 16))}
    amax = {"model.layers.0.mlp.up_proj": 2.0, "model.layers.0.mlp.down_proj": 6.0}
    arrays, hq, _ = modelopt_state(weights, activation_amax=amax)
    tensors = _torch(arrays)
    converter = ModelOptNvfp4Converter(ignore=hq["quantization"]["exclude_modules"],
                                       targets=list(amax))
    out = converter.validate(tensors)
    config = converter.update_config(None)
    (scheme,) = config.config_groups.values()
    for module, a in amax.items():
        state = {n: out[f"{module}.{n}"] for n in NVFP4PackedCompressor.compression_param_names(
            scheme) if f"{module}.{n}" in out}
        got = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        np.testing.assert_array_equal(_theirs(got), _lowbit(weights[module]), err_msg=module)
        assert out[f"{module}.input_global_scale"].item() == np.float32(1.0) / (
            np.float32(a) / np.float32(2688.0))
