"""NVFP4 with a power-of-two tensor scale (``QuantSpec.pow2_tensor_scale``; recipes
``qat_nvfp4_pow2``, ``w4a16_nvfp4_pow2``): the tensor amax rounded up to the smallest
``2688 * 2**k``, checked against the independent NumPy quantizer of tests/reference.py; the
serving engines' arithmetic then gives lowbit's values, so a run of such a recipe exports to
compressed-tensors bit for bit (the default NVFP4 is refused there)."""

from __future__ import annotations

import gzip
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit as lb
from lowbit.core.scales import pow2_tensor_amax
from lowbit.gemm.recipes import QuantSpec
from tests import reference


def _pow2_amax(a: float) -> np.float32:
    """The smallest 2688 * 2**k >= a, by search in float64 (independent of lowbit)."""
    k = 0
    while 2688.0 * 2.0**k < a:
        k += 1
    while 2688.0 * 2.0 ** (k - 1) >= a:
        k -= 1
    return np.float32(2688.0 * 2.0**k)


def _raw(path, name) -> np.ndarray:
    """A tensor's bytes by the safetensors format itself (an 8-byte little-endian header
    length, the JSON header, the data): safetensors' NumPy reader makes no FP8 arrays."""
    import json

    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    info = json.loads(blob[8:8 + n])[name]
    lo, hi = info["data_offsets"]
    return np.frombuffer(blob[8 + n + lo:8 + n + hi], np.uint8).reshape(info["shape"])


def test_pow2_tensor_amax_is_the_smallest_power_of_two_scale_above():
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(1e-6, 1e6, 2000), 2688.0 * 2.0 ** np.arange(-20, 20),
                        [2688.0 * (1 + 2**-23), np.nextafter(np.float32(2688), 0)]])
    a = a.astype(np.float32)
    got = np.asarray(jax.jit(pow2_tensor_amax)(jnp.asarray(a)))
    np.testing.assert_array_equal(got, [_pow2_amax(float(v)) for v in a])
    assert float(pow2_tensor_amax(0.0)) == 0.0


@pytest.mark.parametrize("recipe", ["qat_nvfp4_pow2", "w4a16_nvfp4_pow2"])
def test_the_forward_quantizes_with_a_power_of_two_tensor_scale(recipe):
    x = jax.random.normal(jax.random.key(0), (8, 64)) * 3
    w = jax.random.normal(jax.random.key(1), (64, 48)) * 0.05
    y = lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, implementation="xla")
    wq = reference.nvfp4_quantize(np.asarray(w), axis=0,
                                  tensor_amax=_pow2_amax(float(np.abs(w).max())))
    assert np.frexp(wq.tensor_scale)[0] == 0.5  # a power of two
    xq = np.asarray(x)
    if recipe.startswith("qat"):
        xq = reference.nvfp4_quantize(xq, axis=1,
                                      tensor_amax=_pow2_amax(float(np.abs(xq).max()))).values
    want = np.asarray(jnp.dot(jnp.asarray(xq), jnp.asarray(wq.values),
                              precision=jax.lax.Precision.HIGHEST))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    plain = lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe[:-5])
    assert not np.allclose(np.asarray(plain), want, rtol=1e-6, atol=1e-6)


def test_pow2_needs_one_plain_nvfp4_tensor_scale_and_runs_the_emulation():
    with pytest.raises(ValueError, match=r"pow2_tensor_scale=True needs one NVFP4 / INT4 "
                                         r"tensor scale of the plain rule; got mxfp4"):
        QuantSpec("mxfp4", pow2_tensor_scale=True)
    with pytest.raises(ValueError, match=r"tensor_block=128"):
        QuantSpec("nvfp4", pow2_tensor_scale=True, tensor_block=128)
    with pytest.raises(ValueError, match=r"scale_mode='4over6'"):
        QuantSpec("nvfp4", pow2_tensor_scale=True, scale_mode="4over6")
    x, w = jnp.ones((4, 64)), jnp.ones((64, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lb.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="qat_nvfp4_pow2",
                       implementation="pallas")
    assert any("pow2_tensor_scale (a power-of-two tensor scale runs in the emulation)"
               in str(c.message) for c in caught)


def test_a_pow2_run_exports_to_compressed_tensors_bit_for_bit(tmp_path):
    """The weight a pow2 run packs: compressed-tensors' ``code * (scale / global_scale)``,
    computed here in float32 from the written file, is lowbit's dequantized weight."""
    import json

    import ml_dtypes
    from safetensors import safe_open

    import lowbit.flax as lbf
    from experiments import export, hf, runs, trainer
    from experiments.config import RunConfig
    from tests.test_train import ROOT, quiet, tiny

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    c = tiny(tmp_path, corpus, "w4a16_nvfp4_pow2", steps=2, warmup_steps=0, eval_every=0,
             checkpoint_every=2)
    c.model.update(dict(mlp_act="swiglu", kv_heads=1, ffn_dim=128))
    c.quant.high_precision = "head"
    cfg = RunConfig.from_config(c)
    trainer.train(cfg, log=quiet)
    out = export.export(cfg.run_dir, "compressed-tensors", tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    _, model = runs.load_trained(cfg.run_dir)
    want = hf.to_hf(cfg.model, lbf.pack(model, export.export_rules(cfg)))
    m = "model.layers.0.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        packed = f.get_tensor(m + ".weight_packed")
        g = f.get_tensor(m + ".weight_global_scale")
    scale = _raw(out / "model.safetensors", m + ".weight_scale")  # F8_E4M3 bytes
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    e2m1 = np.concatenate([e2m1, -e2m1])
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    s = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    theirs = e2m1[codes] * (np.repeat(s, 16, axis=1) / g[0])
    ours = np.asarray(lb.dequantize(want[m + ".weight"], jnp.float32))
    np.testing.assert_array_equal(theirs, ours)
