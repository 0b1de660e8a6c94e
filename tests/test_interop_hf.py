"""Interop: a random-initialised checkpoint of each supported architecture, written by
transformers' own ``save_pretrained``, loads into lowbit's GPT (experiments.hf) and gives the
logits of transformers' PyTorch model of that config (float32 both; eager attention).

Tolerance: 2e-5 absolute on logits of magnitude 0.5 to 1.3 (the two sum in different orders in
float32; measured on 2026-12-05 with transformers 5.25 and torch 2.13: at most 3.0e-7).
Run by ``make test-interop``; skipped where torch or transformers is not installed."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.interop
torch = pytest.importorskip("torch", reason="the interop group needs torch (make test-interop)")
transformers = pytest.importorskip(
    "transformers", reason="the interop group needs transformers (make test-interop)")

from experiments import hf  # noqa: E402

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, attn_implementation="eager")
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_theta=50000.0, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0})),
}


def _checkpoint(tmp_path, arch):
    cfg_cls, model_cls, extra = CASES[arch]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("arch", sorted(CASES))
def test_transformers_logits(tmp_path, arch):
    ref = _checkpoint(tmp_path, arch)
    model, cfg = hf.load(tmp_path)
    tokens = np.random.default_rng(2).integers(0, 101, size=(2, 24))
    with torch.no_grad():
        want = ref(torch.tensor(tokens)).logits.float().numpy()
    got = np.asarray(model(np.asarray(tokens, np.int32))[0])
    assert cfg.n_kv_heads == 2 and cfg.vocab == 101
    assert np.abs(want).max() > 0.05  # a model that computes something
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
