"""Interop: a trained Llama-family run exported by ``python -m experiments.export --format
compressed-tensors`` loads in transformers (its compressed-tensors integration, weights
decompressed at load: MXFP4 values are exact in bfloat16, and the model is then cast to
float32) and computes the logits of lowbit's own packed model.

Tolerance: 2e-5 on logits; measured on 2026-12-05 (transformers 5.25, compressed-tensors
0.20.1): 1.9e-6, against 0.06 between lowbit's packed and float models. Run by ``make
test-interop``; skipped where torch, transformers or compressed-tensors is not installed."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

pytestmark = pytest.mark.interop
torch = pytest.importorskip("torch", reason="the interop group needs torch (make test-interop)")
transformers = pytest.importorskip(
    "transformers", reason="the interop group needs transformers (make test-interop)")
pytest.importorskip("compressed_tensors",
                    reason="the interop group needs compressed-tensors (make test-interop)")

import lowbit.flax as lbf  # noqa: E402
from experiments import export, runs, trainer  # noqa: E402
from experiments.config import RunConfig  # noqa: E402
from tests.test_train import ROOT, quiet, tiny  # noqa: E402


def test_transformers_serves_an_exported_mxfp4_run(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    c = tiny(tmp_path, corpus, "w4a16_mxfp4", steps=20, warmup_steps=2, eval_every=0,
             checkpoint_every=20)
    c.model.update(dict(mlp_act="swiglu", kv_heads=1, ffn_dim=128))
    c.quant.high_precision = "head"
    cfg = RunConfig.from_config(c)
    trainer.train(cfg, log=quiet)
    out = export.export(cfg.run_dir, "compressed-tensors", tmp_path / "ct")
    qc = transformers.CompressedTensorsConfig(run_compressed=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, quantization_config=qc)
    ref = ref.eval().float()
    _, model = runs.load_trained(cfg.run_dir)
    served = lbf.quantize(model, export.export_rules(cfg))
    tokens = np.frombuffer(b"hello world, this is a test of it", np.uint8).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens[None], dtype=torch.long)).logits.numpy()
    got = np.asarray(served(tokens[None])[0])
    quant = np.abs(np.asarray(model(tokens[None])[0]) - got).max()
    assert quant > 0.01  # the packed model is not the float one ...
    np.testing.assert_allclose(want, got, rtol=0, atol=2e-5)  # ... and transformers serves it
