"""Llama-family checkpoints in Hugging Face's layout (experiments.hf): the loaded GPT computes
the logits of an independent float64 NumPy transcription of transformers' Llama / Mistral /
Qwen2 / Qwen3 forward, written here; bad checkpoints get errors naming the tensor or option.
(transformers' own PyTorch models are checked in tests/test_interop_hf.py, the interop group.)"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from experiments import hf
from experiments.model import GPTConfig, n_params

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
            hidden_act="silu")
ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=5),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def _config(arch):
    return {**BASE, **ARCHS[arch]}


def _tensors(cfg, seed=0):
    """Random weights under Hugging Face's names and [out, in] layout."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(d)
        t[p + "post_attention_layernorm.weight"] = 1 + w(d)
        for n, m in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
            t[f"{p}self_attn.{n}_proj.weight"] = w(m, d)
            if cfg["model_type"] == "qwen2":
                t[f"{p}self_attn.{n}_proj.bias"] = w(m)
        t[p + "self_attn.o_proj.weight"] = w(d, h * hd)
        if cfg["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + w(hd)
            t[p + "self_attn.k_norm.weight"] = 1 + w(hd)
        t[p + "mlp.gate_proj.weight"] = w(f, d)
        t[p + "mlp.up_proj.weight"] = w(f, d)
        t[p + "mlp.down_proj.weight"] = w(d, f)
    return t


def _write(tmp_path, cfg, tensors):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


# An independent float64 transcription of transformers' forward for these four models.


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(cfg, hd):
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    rs = cfg.get("rope_scaling")
    if rs and rs["rope_type"] == "linear":
        inv = inv / rs["factor"]
    elif rs and rs["rope_type"] == "llama3":
        old, lo, hi = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                       rs["high_freq_factor"])
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl < old / hi:
                out.append(f)
            elif wl > old / lo:
                out.append(f / rs["factor"])
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * f / rs["factor"] + s * f)
        inv = np.array(out)
    return inv


def _rope(x, inv):  # x [T, H, hd]: rotate-half
    t = x.shape[0]
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x1, x2 = np.split(x, 2, axis=-1)
    return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]


def _reference_logits(cfg, t, tokens):
    g = {k: v.astype(np.float64) for k, v in t.items()}
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = cfg.get("head_dim") or d // h, cfg["rms_norm_eps"]
    x = g["model.embed_tokens.weight"][tokens]
    n = len(tokens)
    inv = _inv_freq(cfg, hd)
    mask = np.tril(np.ones((n, n), bool))
    if cfg.get("sliding_window"):
        mask &= np.arange(n)[None, :] > np.arange(n)[:, None] - cfg["sliding_window"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, g[p + "input_layernorm.weight"], eps)

        def proj(name, a=a, p=p):
            y = a @ g[f"{p}self_attn.{name}_proj.weight"].T
            b = g.get(f"{p}self_attn.{name}_proj.bias")
            return y if b is None else y + b

        q = proj("q").reshape(n, h, hd)
        k = proj("k").reshape(n, kv, hd)
        v = proj("v").reshape(n, kv, hd)
        if cfg["model_type"] == "qwen3":
            q = _rms(q, g[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, g[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, inv), _rope(k, inv)
        out = np.zeros((n, h, hd))
        for head in range(h):
            kh, vh = k[:, head // (h // kv)], v[:, head // (h // kv)]
            s = q[:, head] @ kh.T / math.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ vh
        x = x + out.reshape(n, h * hd) @ g[p + "self_attn.o_proj.weight"].T
        m = _rms(x, g[p + "post_attention_layernorm.weight"], eps)
        gate = m @ g[p + "mlp.gate_proj.weight"].T
        up = m @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    x = _rms(x, g["model.norm.weight"], eps)
    head = g["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else g["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_loaded_checkpoint_computes_transformers_logits(tmp_path, arch):
    cfg = _config(arch)
    t = _tensors(cfg)
    model, gcfg = hf.load(_write(tmp_path, cfg, t))
    assert gcfg.vocab == 97 and gcfg.n_kv_heads == 2 and gcfg.mlp_act == "swiglu"
    assert n_params(gcfg) == sum(v.size for v in t.values())  # the closed form, and no
    assert n_params(gcfg) == sum(  # checkpoint tensor left out
        p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tokens = np.random.default_rng(1).integers(0, 97, size=12)
    got = np.asarray(model(np.asarray(tokens, np.int32)[None])[0][0], np.float64)
    want = _reference_logits(cfg, t, tokens)
    # float32 arithmetic against float64: logits of size ~5, errors ~1e-5
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_and_sharded_checkpoints_load(tmp_path):
    import ml_dtypes

    cfg = _config("llama")
    t = _tensors(cfg, seed=3)
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    names = sorted(t)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {"total_size": sum(v.nbytes for v in t.values())},
             "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = hf.load(tmp_path)
    tokens = np.arange(10) % 97
    want = _reference_logits(cfg, {k: v.astype(np.float32) for k, v in t.items()}, tokens)
    got = np.asarray(model(np.asarray(tokens, np.int32)[None])[0][0], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_and_options_are_named(tmp_path):
    cfg = {**_config("llama"), "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
    with pytest.raises(hf.UnsupportedCheckpoint,
                       match=r"architecture \['GemmaForCausalLM'\] is not supported; supported: "
                             r"\['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', "
                             r"'Qwen3ForCausalLM'\]"):
        hf.gpt_config(cfg)
    with pytest.raises(hf.UnsupportedCheckpoint, match="rope_scaling type 'yarn' is not "
                                                       "supported"):
        hf.gpt_config({**_config("qwen3"), "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(hf.UnsupportedCheckpoint, match="attention_bias=true"):
        hf.gpt_config({**_config("llama"), "attention_bias": True})
    with pytest.raises(hf.UnsupportedCheckpoint, match="no config.json"):
        hf.load(tmp_path)


def test_a_tensor_that_disagrees_with_the_config_is_named(tmp_path):
    cfg = _config("qwen2")
    t = _tensors(cfg)
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(hf.UnsupportedCheckpoint,
                       match=r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape "
                             r"\(32, 32\), config.json implies \(16, 32\)"):
        hf.load(_write(tmp_path, cfg, t))
    del t["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(hf.UnsupportedCheckpoint,
                       match=r"tensor 'model.layers.1.self_attn.k_proj.weight' is missing"):
        hf.load(_write(tmp_path, cfg, t))


def test_a_run_starts_from_a_hugging_face_checkpoint(tmp_path):
    """``--config.init_from_hf``: the checkpoint's config is the model section and its
    weights the parameters (one step at lr 1e-12 leaves them within 1e-9 of the checkpoint's,
    where the random init is ~0.02 away); a vocabulary below the byte data's is refused."""
    import gzip

    import jax

    from experiments import trainer
    from experiments.config import RunConfig
    from experiments.configlib import ConfigError
    from tests.test_init_from import _params
    from tests.test_train import ROOT, quiet, tiny

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    cfg = {**_config("qwen3"), "vocab_size": 300, "num_hidden_layers": 1}
    t = _tensors(cfg, seed=5)
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    _write(ckpt, cfg, t)
    c = tiny(tmp_path, corpus, steps=1, lr=1e-12, warmup_steps=0, eval_every=0,
             checkpoint_every=1)
    c.init_from_hf = str(ckpt)
    run = RunConfig.from_config(c)
    assert run.model.vocab == 300 and run.model.qk_norm and run.model.head_dim == 16
    trainer.train(run, log=quiet)
    got = _params(run, 1)
    model, _ = hf.load(ckpt)
    from flax import nnx

    want = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree.leaves_with_path(nnx.split(model, nnx.Param, ...)[1])}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-9, err_msg=k)
    # a study's fine-tune of that run (ptq_vs_qat's QAT rows) keeps the checkpoint's model
    from experiments.config import fine_tune_config

    ft = RunConfig.from_config(fine_tune_config(c, recipe="qat_nvfp4", name="ft", steps=2,
                                                lr=1e-3, init_from=str(run.run_dir)))
    assert ft.model == run.model and not ft.init_from_hf and ft.init_from
    (tmp_path / "small").mkdir()
    c.init_from_hf = str(_write(tmp_path / "small", {**cfg, "vocab_size": 200}, t))
    with pytest.raises(ConfigError, match=r"vocab_size=200 is below the byte data's 256"):
        RunConfig.from_config(c)


def test_llama_family_fields_are_checked():
    with pytest.raises(ValueError, match="heads=4 must be a multiple of kv_heads=3"):
        GPTConfig(d_model=32, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="mlp_act='swiglu' is for the dense MLP"):
        GPTConfig(mlp="moe", mlp_act="swiglu")
    with pytest.raises(ValueError, match="rope_scaling must be one of"):
        GPTConfig(rope_scaling="yarn")
    with pytest.raises(ValueError, match="kv_heads must be an int >= 0"):
        GPTConfig(kv_heads=-1)


def test_a_run_written_before_the_llama_fields_compares_equal():
    """Runs saved before GPTConfig grew the Llama family's fields resume and are reused: a
    missing field reads as its default (config.ADDED)."""
    from experiments.config import RunConfig, config_diff
    from experiments.configlib import load_config
    from experiments.model import LLAMA_FIELDS
    from tests.test_train import ROOT

    now = RunConfig.from_config(load_config(f"{ROOT / 'configs/gpt.py'}:size=tiny")).to_json()
    saved = json.loads(json.dumps(now))
    for f in LLAMA_FIELDS:
        del saved["model"][f]
    del saved["init_from_hf"]
    assert config_diff(saved, now) == []
    saved["model"]["kv_heads"] = 1
    assert config_diff(saved, now) == ["model.kv_heads: 1 -> 0"]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_to_hf_inverts_load_and_keeps_packed_codes(tmp_path, arch):
    """The export mapping returns every checkpoint tensor as it was read; a packed model's
    q/k/v pieces are rows of the fused kernel's codes (their dequantized values are the
    fused kernel's, its one NVFP4 tensor scale shared)."""
    import lowbit as lb
    import lowbit.flax as lbf

    cfg = _config(arch)
    t = _tensors(cfg)
    model, gcfg = hf.load(_write(tmp_path, cfg, t))
    assert hf.gpt_config(hf.hf_config(gcfg)) == gcfg
    params = nnx.state(model, nnx.Param)
    back = hf.to_hf(gcfg, params)
    assert sorted(back) == sorted(t)
    for k in t:
        np.testing.assert_array_equal(back[k], t[k], err_msg=k)
    rules = [(r".*/(qkv|gate)", "qat_nvfp4"), (".*", "none")]
    packed_state = lbf.pack(model, rules)
    packed = hf.to_hf(gcfg, packed_state)
    fused_q = packed_state["blocks"][0]["attn"]["qkv"]["kernel"].get_value()
    fused = np.asarray(lb.dequantize(fused_q)).T
    pieces = [packed[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert all(isinstance(p, lb.QArray) and p.axes == (1,) for p in pieces)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(lb.dequantize(p)) for p in pieces]), fused)
    assert isinstance(packed["model.layers.1.mlp.gate_proj.weight"], lb.QArray)
    assert not isinstance(packed["model.layers.1.mlp.up_proj.weight"], lb.QArray)
