"""``python -m experiments.export``: a trained Llama-family GPT written for llama.cpp (GGUF),
its packed weights as they are; read back by gguf-py (llama.cpp's own reader) and decoded by
its ``quants.dequantize``, every tensor is lowbit's packed tensor, bit for bit. Models and
formats the engine cannot take are refused by name."""

from __future__ import annotations

import gzip

import gguf
import numpy as np
import pytest

import lowbit as lb
import lowbit.flax as lbf
from experiments import export, hf, runs, trainer
from experiments.config import RunConfig
from experiments.configlib import ConfigError
from tests.test_train import ROOT, quiet, tiny


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def _run(tmp_path, corpus, recipe, **model):
    c = tiny(tmp_path, corpus, recipe, steps=2, warmup_steps=0, eval_every=0,
             checkpoint_every=2)
    c.model.update(dict(mlp_act="swiglu", kv_heads=1, ffn_dim=128, **model))
    c.quant.high_precision = r"head"
    cfg = RunConfig.from_config(c)
    trainer.train(cfg, log=quiet)
    return cfg


def _decoded(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    scale = [s for s in reader.tensors if s.name == name.replace(".weight", ".scale")]
    return (x * np.asarray(scale[0].data)[0]) if scale else x, t.tensor_type


@pytest.mark.parametrize("recipe, ggml", [("w4a16_mxfp4", "MXFP4"), ("w4a16_nvfp4", "NVFP4")])
def test_gguf_holds_the_packed_weights_bit_for_bit(tmp_path, corpus, recipe, ggml):
    cfg = _run(tmp_path, corpus, recipe)
    path = export.export(cfg.run_dir, "gguf", tmp_path / "out")
    _, model = runs.load_trained(cfg.run_dir)
    packed = lbf.pack(model, export.export_rules(cfg))
    want = hf.to_hf(cfg.model, packed)
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names and "blk.0.ffn_gate.weight" in names
    q = cfg.model.heads * cfg.model.head_dim
    perm = np.arange(q).reshape(cfg.model.heads, 2, -1).swapaxes(1, 2).reshape(-1)
    checks = {"blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", perm),
              "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", None),
              "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj.weight", None),
              "output.weight": ("lm_head.weight", None),
              "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", None)}
    for gname, (hname, rows) in checks.items():
        got, ttype = _decoded(reader, gname)
        w = want[hname]
        ref = np.asarray(lb.dequantize(w, np.float32)) if isinstance(w, lb.QArray) else w
        ref = ref if rows is None else ref[rows]
        if isinstance(w, lb.QArray):
            assert ttype.name == ggml, gname
            ref = np.where(ref == 0, 0.0, ref)  # GGML decodes E2M1's -0 as +0
        else:
            assert ttype.name == "F32", gname
        np.testing.assert_array_equal(got.reshape(ref.shape), ref, err_msg=gname)
    md = {f.name: f for f in reader.fields.values()}
    arch = "qwen2" if cfg.model.qkv_bias else "llama"
    assert bytes(md["general.architecture"].parts[-1]).decode() == arch
    assert int(md[f"{arch}.attention.head_count_kv"].parts[-1][0]) == 1


def test_export_refuses_what_the_engine_cannot_express(tmp_path, corpus):
    c = tiny(tmp_path, corpus, "w4a16_mxfp4", steps=2, warmup_steps=0, eval_every=0,
             checkpoint_every=2)
    cfg = RunConfig.from_config(c)  # the byte GPT: a GELU MLP
    trainer.train(cfg, log=quiet)
    with pytest.raises(ConfigError, match=r"no Llama-family equivalent: mlp='dense', "
                                          r"mlp_act='gelu'"):
        export.export(cfg.run_dir, "gguf", tmp_path / "o1")
    mx8 = _run(tmp_path / "b", corpus, "qat_mxfp8")
    with pytest.raises(ConfigError, match=r"is mxfp8_e4m3: llama.cpp's GGUF holds \['mxfp4', "
                                          r"'nvfp4'\] weights"):
        export.export(mx8.run_dir, "gguf", tmp_path / "o2")
    with pytest.raises(ConfigError, match=r"--format='onnx': expected one of"):
        export.export(mx8.run_dir, "onnx", tmp_path / "o3")
    assert export.main(["--run", str(tmp_path / "nope"), "--format", "gguf",
                        "--out", str(tmp_path / "o4")]) == 1



def _hf_weights(cfg):
    _, model = runs.load_trained(cfg.run_dir)
    return hf.to_hf(cfg.model, lbf.pack(model, export.export_rules(cfg)))


def test_compressed_tensors_and_modelopt_hold_the_packed_codes(tmp_path, corpus):
    import json

    from safetensors import safe_open

    def load(path, *names):  # the named tensors (safetensors' NumPy reader makes no FP8)
        with safe_open(str(path), "numpy") as f:
            return {n: f.get_tensor(n) for n in names}

    mx = _run(tmp_path / "mx", corpus, "w4a16_mxfp4")
    out = export.export(mx.run_dir, "compressed-tensors", tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["input_activations"] is None  # weight-only, as the recipe
    assert "model.layers.0.self_attn.k_proj" in group["targets"]
    k = "model.layers.0.self_attn.k_proj."
    st = load(out / "model.safetensors", k + "weight_packed", k + "weight_scale")
    want = _hf_weights(mx)["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(st["model.layers.0.self_attn.k_proj.weight_packed"],
                                  np.asarray(want.codes))
    np.testing.assert_array_equal(st["model.layers.0.self_attn.k_proj.weight_scale"],
                                  np.asarray(want.scales))

    nv = _run(tmp_path / "nv", corpus, "w4a16_nvfp4")
    out = export.export(nv.run_dir, "modelopt", tmp_path / "mo")
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["group_size"] == 16
    assert hq["exclude_modules"] == ["lm_head"]
    d = "model.layers.0.mlp.down_proj."
    st = load(out / "model.safetensors", d + "weight", d + "weight_scale_2")
    want = _hf_weights(nv)["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(st["model.layers.0.mlp.down_proj.weight"],
                                  np.asarray(want.codes))
    assert st["model.layers.0.mlp.down_proj.weight_scale_2"] == np.float32(want.tensor_scale)
    # lowbit's NVFP4 tensor scale amax / 2688 is rarely a power of two: compressed-tensors'
    # reciprocal global scale would change the values, and the export says so
    with pytest.raises(ConfigError, match=r"compressed-tensors.*exact_tensor_amax"):
        export.export(nv.run_dir, "compressed-tensors", tmp_path / "ct2")


def test_nvfp4_activations_need_a_calibration(tmp_path, corpus):
    import lowbit.ptq as ptq

    cfg = _run(tmp_path, corpus, "qat_nvfp4")
    with pytest.raises(ConfigError, match=r"site 'blocks/0/attn/qkv' \(qat_nvfp4\) quantizes "
                                          r"its inputs in nvfp4 with a dynamic tensor scale; "
                                          r"ModelOpt takes a static input scale"):
        export.export(cfg.run_dir, "modelopt", tmp_path / "o")
    _, model = runs.load_trained(cfg.run_dir)
    rules = export.export_rules(cfg)
    tokens = np.frombuffer(b"the quick brown fox jumps over the lazy dog, twice over!",
                           np.uint8).astype(np.int32)[None]
    cal = ptq.calibrate(model, rules, [tokens])
    cal.save(tmp_path / "cal.json")
    out = export.export(cfg.run_dir, "modelopt", tmp_path / "o", calibration=tmp_path / "cal.json")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "numpy") as f:  # (FP8 tensors: not read)
        got = f.get_tensor("model.layers.0.mlp.gate_proj.input_scale")
    amax = cal.amax["blocks/0/mlp/gate"]
    np.testing.assert_array_equal(got, np.float32(amax) / np.float32(6 * 448))


def test_a_plan_packs_its_sites_and_names_sites_the_model_lacks(tmp_path, corpus):
    from lowbit.autoquant import PrecisionPlan

    cfg = _run(tmp_path, corpus, "none")

    def plan(path, site):
        PrecisionPlan(choices={"s": "w4a16_mxfp4"}, members={"s": (site,)},
                      recipes={"w4a16_mxfp4": lb.recipes.get("w4a16_mxfp4")}, bits=4.25,
                      budget=5.0, predicted=0.0, method="isolated").save(path)
        return path

    good = plan(tmp_path / "good.json", "blocks/0/mlp/down")
    reader = gguf.GGUFReader(export.export(cfg.run_dir, "gguf", tmp_path / "o", plan=good))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "MXFP4"
    assert types["blk.0.ffn_up.weight"] == types["blk.0.attn_q.weight"] == "F32"
    bad = plan(tmp_path / "bad.json", "blocks/7/mlp/down")
    with pytest.raises(ConfigError, match=r"sites \['blocks/7/mlp/down'\] are not in the "
                                          r"run's model"):
        export.export(cfg.run_dir, "gguf", tmp_path / "o2", plan=bad)


def test_a_mixed_precision_plan_exports_to_modelopt(tmp_path, corpus):
    import json

    from lowbit.autoquant import PrecisionPlan

    cfg = _run(tmp_path, corpus, "none")
    names = ("w4a16_nvfp4", "qat_mxfp8")
    plan = PrecisionPlan(choices={"a": "w4a16_nvfp4", "b": "qat_mxfp8"},
                         members={"a": ("blocks/0/mlp/down",), "b": ("blocks/0/attn/qkv",)},
                         recipes={n: lb.recipes.get(n) for n in names}, bits=6.0, budget=6.0,
                         predicted=0.0, method="isolated").save(tmp_path / "plan.json")
    out = export.export(cfg.run_dir, "modelopt", tmp_path / "mo", plan=plan)
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    layers = {k: v["quant_algo"] for k, v in q["quantized_layers"].items()}
    assert layers == {"model.layers.0.mlp.down_proj": "W4A16_NVFP4",
                      **{f"model.layers.0.self_attn.{n}_proj": "MXFP8" for n in "qkv"}}
