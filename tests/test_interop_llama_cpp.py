"""Interop: llama.cpp itself (llama-cpp-python, built from its source package) runs a GGUF that
``experiments.export`` wrote from a small Llama-family GPT trained on the byte data with
MXFP4 / NVFP4 weights, and gives the next-token log-probabilities of lowbit's own evaluation
of the same packed model.

Tolerance: llama.cpp's CPU backend multiplies its MXFP4 / NVFP4 weights by activations it
rounds to Q8_0 (8-bit integers with a scale per 32 values; ``vec_dot_type``), which lowbit's
weight-only model keeps in float32; the test bounds the log-probability difference by 0.05
nats at every position and, so that the bound means something, by a tenth of the difference
between lowbit's packed and float models (llama.cpp computes the quantized model, not the
float one). Measured on 2026-12-05 (llama-cpp-python 0.3.36, 300 steps, loss 5.55 -> 2.50):
MXFP4 at most 0.0072 nats, 0.0023 on average, against 0.037 between packed and float; NVFP4
0.018, 0.0025 and 0.030. Run by ``make test-interop``; skipped where llama_cpp is not
installed."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

pytestmark = pytest.mark.interop
llama_cpp = pytest.importorskip(
    "llama_cpp", reason="the interop group needs llama-cpp-python (make test-interop)")

import jax  # noqa: E402

import lowbit.flax as lbf  # noqa: E402
from experiments import export, runs, trainer  # noqa: E402
from experiments.config import RunConfig  # noqa: E402
from tests.test_train import ROOT, quiet, tiny  # noqa: E402

STEPS = 300


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


LLAMA3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_original_len=16)


@pytest.mark.parametrize("recipe, model", [("w4a16_mxfp4", {}), ("w4a16_nvfp4", {}),
                                           ("w4a16_mxfp4", LLAMA3)],
                         ids=["mxfp4", "nvfp4", "mxfp4-llama3-rope"])
def test_llama_cpp_gives_lowbits_log_probabilities(tmp_path, recipe, model):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    c = tiny(tmp_path, corpus, recipe, steps=STEPS, warmup_steps=10, eval_every=0,
             checkpoint_every=STEPS, lr=3e-3)
    c.model.update(dict(mlp_act="swiglu", kv_heads=1, ffn_dim=128, **model))
    c.quant.high_precision = "head"
    cfg = RunConfig.from_config(c)
    result = trainer.train(cfg, log=quiet)
    assert result.losses[STEPS] < result.losses[1] - 1.0  # it learned the bytes
    path = export.export(cfg.run_dir, "gguf", tmp_path / "gguf")

    _, model = runs.load_trained(cfg.run_dir)
    served = lbf.quantize(model, export.export_rules(cfg))  # = the packed model's logits
    text = (ROOT / "README.md").read_bytes()[:48]
    tokens = np.frombuffer(text, np.uint8).astype(np.int32)
    lowbit_lp = _log_softmax(jax.device_get(served(tokens[None])[0][0]))
    float_lp = _log_softmax(jax.device_get(model(tokens[None])[0][0]))

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=2,
                          verbose=False)
    llm.eval(tokens.tolist())
    llama_lp = _log_softmax(np.asarray(llm.scores[: len(tokens)]))

    nxt = tokens[1:]
    pick = (np.arange(len(nxt)), nxt)
    diff = np.abs(llama_lp[:-1][pick] - lowbit_lp[:-1][pick])
    quant = np.abs(float_lp[:-1][pick] - lowbit_lp[:-1][pick])
    assert diff.max() < 0.05, diff.max()
    assert diff.mean() < 0.1 * quant.mean(), (diff.mean(), quant.mean())
