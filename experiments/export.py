"""A trained (QAT, PTQ'd or autoquant-planned) Llama-family GPT written for a serving engine.

    python -m experiments.export --run runs/gpt-s/w4a16_nvfp4-s0 --format gguf --out out/
    python -m experiments.export --run <run dir> --plan plan.json --format gguf --out out/
    python -m experiments.export --run <run dir> --format compressed-tensors --out out/ \
        [--calibration cal.json]

The run's latest checkpoint is packed by its own rules (``quant.recipe``, ``quant.plan``,
``quant.high_precision``; ``--plan``: an autoquant plan's sites in their recipes, every other
site in float): each quantized weight is the :class:`lowbit.QArray` lowbit's own packed model
serves (:func:`lowbit.flax.pack`), written as it is, never requantized, so that what the engine
serves is bit for bit the weights lowbit evaluated. The model must be of the Llama family
(:func:`experiments.hf.architecture`: a SwiGLU MLP, RoPE; ``configs/gpt.py`` with
``model.mlp_act=swiglu``, or a run started from a Hugging Face checkpoint).

``--format compressed-tensors`` (vLLM, transformers) and ``--format modelopt`` (TensorRT-LLM,
vLLM, SGLang): a Hugging Face directory (``config.json`` of the architecture,
:func:`experiments.hf.hf_config`; ``model.safetensors``) in those formats
(:func:`lowbit.io.write_compressed_tensors`, :func:`lowbit.io.write_modelopt`): NVFP4 /
MXFP4 / MXFP8 weights packed, float sites listed as ignored / excluded. Activations: a site
whose recipe quantizes its inputs in an MX format is exported with the engine's dynamic MX
activation scheme; NVFP4 inputs need the engine's static input scale, so they are exported
from ``--calibration`` (a :class:`lowbit.ptq.Calibration` of this model, its per-site amax),
and without one the export refuses (lowbit's NVFP4 activation scale is dynamic, which neither
format expresses).

``--format gguf`` (llama.cpp): ``<out>/model.gguf`` (:func:`gguf_tensors`,
:func:`gguf_metadata`): llama.cpp's tensor names and hyper-parameters for its ``llama``,
``qwen2`` and ``qwen3`` architectures (q and k rows permuted for ``llama``'s RoPE, Llama 3's
RoPE bands as its ``rope_freqs`` tensor), MXFP4 and NVFP4 weights as GGML's MXFP4 / NVFP4
(:func:`lowbit.io.write_gguf`), everything else F32, and a byte-level vocabulary (token ``i``
is the byte ``i``, as lowbit's data pipeline tokenizes). llama.cpp multiplies its quantized
weights by activations it quantizes itself (Q8_0 on its CPU backend), so its log-probabilities
differ from lowbit's packed model by that activation rounding (tests/test_interop_llama_cpp.py
measures it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import lowbit.flax as lbf
import lowbit.ptq as ptq
from experiments import hf, runs
from experiments.config import quant_rules
from experiments.configlib import ConfigError
from experiments.model import GPTConfig
from lowbit import autoquant
from lowbit.io import write_compressed_tensors, write_gguf, write_modelopt
from lowbit.io.tree import is_qarray
from lowbit.io.views import take_rows

__all__ = ["FORMATS", "GGUF_FORMATS", "export", "export_rules", "gguf_tensors",
           "gguf_metadata", "main"]

FORMATS = ("gguf", "compressed-tensors", "modelopt")
# weight formats each target holds (engine, its file format): others are refused by name
GGUF_FORMATS = ("mxfp4", "nvfp4")
# llama.cpp's architecture for each Hugging Face one (Mistral's sliding window aside)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Hugging Face's per-layer names -> llama.cpp's (gguf-py's tensor name map)
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def export_rules(cfg, plan: str | None = None, model=None) -> list:
    """The rules a run's model is packed by: its own (:func:`experiments.config.quant_rules`),
    or with ``plan`` (a saved autoquant plan) the plan's sites in their recipes and every other
    site in float; given the ``model``, a plan site it does not have is an error."""
    if plan is None:
        return quant_rules(cfg.quant)
    try:
        p = autoquant.Plan.load(plan)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--plan={str(plan)!r}: {e}") from e
    if model is not None:
        have = {s.path for s in lbf.sites(model, [])}
        missing = sorted({m for ms in p.members.values() for m in ms} - have)
        if missing:
            raise ConfigError(f"--plan={str(plan)!r}: sites {missing} are not in the run's "
                              f"model (its sites: {sorted(have)})")
    return p.rules() + [(".*", "none")]


def _rope_permutation(rows: int, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q and k of its ``llama`` architecture, whose
    RoPE rotates adjacent pairs where Hugging Face's rotates halves: within each head, rows
    ``(0, h/2, 1, h/2 + 1, ...)`` (ggml-org/llama.cpp ``convert_hf_to_gguf.py``,
    ``LlamaModel.permute``: ``reshape(n_head, 2, dim // n_head // 2).swapaxes(1, 2)``)."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def _permute_rows(x, perm: np.ndarray):
    return take_rows(x, perm) if is_qarray(x) else np.asarray(x)[perm]


def gguf_tensors(cfg: GPTConfig, tensors: dict) -> dict:
    """Hugging Face tensors (:func:`experiments.hf.to_hf`) under llama.cpp's names, q and k
    rows permuted for its ``llama`` architecture; float tensors as float32, QArrays as they
    are (MXFP4 / NVFP4 only: llama.cpp has no type for the others)."""
    arch = GGUF_ARCH[hf.architecture(cfg)]
    out = {}
    for name, x in tensors.items():
        if name in _GGUF_TOP:
            gname = _GGUF_TOP[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_LAYER[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.heads if rest.startswith("self_attn.q") else cfg.n_kv_heads
                x = _permute_rows(x, _rope_permutation(x.shape[0], heads))
        if is_qarray(x) and x.format_name not in GGUF_FORMATS:
            raise ConfigError(
                f"tensor {name!r} is {x.format_name}: llama.cpp's GGUF holds {list(GGUF_FORMATS)} "
                "weights (and floats); export it with --format compressed-tensors or modelopt, "
                "or pack it in mxfp4 / nvfp4"
            )
        out[gname] = x if is_qarray(x) else np.asarray(x, np.float32)
    if cfg.rope_scaling == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    return out


def _llama3_rope_factors(cfg: GPTConfig) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor of Llama 3's RoPE bands: per frequency the factor
    it divides the frequency by (1 in the high band, ``rope_factor`` in the low band, the
    interpolation between), as its converter computes it (llama.cpp vendored by
    llama-cpp-python 0.3.36, ``conversion/llama.py:298-326``; the same bands as
    :func:`experiments.model.rope_frequencies`)."""
    k = cfg.head_dim
    freqs = 1.0 / cfg.rope_base ** (np.arange(0, k, 2, dtype=np.float32) / k)
    low = cfg.rope_original_len / cfg.rope_low_freq
    high = cfg.rope_original_len / cfg.rope_high_freq
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(cfg.rope_factor)
        else:
            smooth = ((cfg.rope_original_len / wavelen - cfg.rope_low_freq)
                      / (cfg.rope_high_freq - cfg.rope_low_freq))
            out.append(1 / ((1 - smooth) / cfg.rope_factor + smooth))
    return np.asarray(out, np.float32)


def _byte_vocab(vocab: int) -> dict:
    """A SentencePiece-type vocabulary llama.cpp tokenizes as lowbit's data pipeline does:
    token ``i < 256`` is the byte ``i`` (``<0xXX>``, type BYTE: llama.cpp's byte fallback
    maps every byte of a text to it), tokens past 256 unused."""
    tokens = [f"<0x{i:02X}>" for i in range(min(vocab, 256))]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    types = [6] * min(vocab, 256) + [5] * (vocab - min(vocab, 256))  # BYTE, UNUSED
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * vocab,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }


def gguf_metadata(cfg: GPTConfig, name: str = "lowbit") -> dict:
    """llama.cpp's hyper-parameter keys for the GPT (``<arch>.*``, gguf-py's ``Keys.LLM`` /
    ``Keys.Attention`` / ``Keys.Rope``) and :func:`_byte_vocab`. Raises ConfigError for what
    llama.cpp's architectures cannot express: a sliding window, Llama 3's RoPE bands."""
    arch = GGUF_ARCH[hf.architecture(cfg)]
    if cfg.sliding_window and cfg.sliding_window < cfg.seq_len:
        raise ConfigError(f"model.sliding_window={cfg.sliding_window}: llama.cpp's {arch!r} "
                          "architecture attends to the whole context")
    if cfg.rope_scaling == "llama3" and arch != "llama":
        raise ConfigError(f"model.rope_scaling='llama3': llama.cpp's {arch!r} architecture "
                          "takes no rope_freqs tensor")
    md = {
        "general.architecture": arch,
        "general.name": name,
        f"{arch}.context_length": cfg.seq_len,
        f"{arch}.embedding_length": cfg.d_model,
        f"{arch}.block_count": cfg.layers,
        f"{arch}.feed_forward_length": cfg.d_ff,
        f"{arch}.attention.head_count": cfg.heads,
        f"{arch}.attention.head_count_kv": cfg.n_kv_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        f"{arch}.rope.freq_base": float(cfg.rope_base),
        f"{arch}.rope.dimension_count": cfg.head_dim,
        f"{arch}.vocab_size": cfg.vocab,
    }
    if cfg.rope_scaling == "linear":
        md[f"{arch}.rope.scaling.type"] = "linear"
        md[f"{arch}.rope.scaling.factor"] = float(cfg.rope_factor)
    return {**md, **_byte_vocab(cfg.vocab)}


def _hf_split(tensors: dict) -> tuple[dict, dict]:
    """``(weights by linear module name, other tensors by name)`` of :func:`hf.to_hf`'s."""
    weights, rest = {}, {}
    for name, x in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            weights[name[: -len(".weight")]] = x
        else:
            rest[name] = x
    return weights, rest


def _activations(cfg, rules, weights: dict, fmt: str, calibration) -> tuple[dict, bool]:
    """``(activation amax by module, MX activations?)`` of the packed modules, from each
    site's recipe (:func:`lowbit.flax.Rules`) and ``calibration``'s static amaxes."""
    rules = lbf.Rules.of(rules)
    amax, mx = {}, set()
    for module, w in weights.items():
        site = hf.site_of(module)
        recipe = rules.active(site)
        lhs = None if recipe is None or not is_qarray(w) else recipe.fwd.lhs
        if lhs is None:
            continue
        if lhs.format.startswith("mx"):
            mx.add(module)
        elif calibration is not None and site in calibration.amax:
            amax[module] = calibration.amax[site]
        else:
            engine = "compressed-tensors" if fmt == "compressed-tensors" else "ModelOpt"
            raise ConfigError(
                f"site {site!r} ({recipe.name}) quantizes its inputs in {lhs.format} with a "
                f"dynamic tensor scale; {engine} takes a static input scale: pass "
                "--calibration (lowbit.ptq.calibrate(...).save(path)) or pack by a weight-only "
                "recipe"
            )
    quantized = {m for m, w in weights.items() if is_qarray(w)}
    if mx and fmt == "compressed-tensors" and mx != {m for m in quantized
                                                        if weights[m].format_name.startswith("mx")}:
        raise ConfigError("compressed-tensors: MX activations are one switch for every MX "
                          "module; this model quantizes the inputs of some MX sites only")
    return amax, bool(mx)


def _write_hf(cfg, fmt: str, out: Path, tensors: dict, rules, calibration) -> Path:
    weights, rest = _hf_split(tensors)
    amax, mx = _activations(cfg, rules, weights, fmt, calibration)
    config = hf.hf_config(cfg.model)
    try:
        if fmt == "compressed-tensors":
            return write_compressed_tensors(out, weights, rest, config=config, layout="hf",
                                            activation_amax=amax, mx_activations=mx)
        return write_modelopt(out, weights, rest, config=config, layout="hf",
                              activation_amax=amax)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def export(run_dir, fmt: str, out, *, plan: str | None = None,
           calibration: str | None = None) -> Path:
    """Write the run ``run_dir``'s model, packed (:func:`export_rules`), to the directory
    ``out`` in ``fmt`` (:data:`FORMATS`); returns what was written (the GGUF file, or the
    Hugging Face directory). ``calibration``: a saved :class:`lowbit.ptq.Calibration`, the
    static input scales of NVFP4 activations. Raises ConfigError for a bad run, plan or
    format, a model outside the Llama family, and what the target cannot express (naming
    the engine and the format)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format={fmt!r}: expected one of {list(FORMATS)}")
    cfg, model = runs.load_trained(run_dir)
    if cfg.family != "gpt":
        raise ConfigError(f"--run={str(run_dir)!r}: a {cfg.family!r} run; export writes the "
                          "gpt family's Llama-family models")
    try:
        hf.architecture(cfg.model)
    except hf.UnsupportedCheckpoint as e:
        raise ConfigError(f"--run={str(run_dir)!r}: {e}") from None
    rules = export_rules(cfg, plan, model)
    tensors = hf.to_hf(cfg.model, lbf.pack(model, rules))
    out = Path(out)
    if fmt != "gguf":
        cal = None if calibration is None else ptq.Calibration.load(calibration)
        return _write_hf(cfg, fmt, out, tensors, rules, cal)
    out.mkdir(parents=True, exist_ok=True)
    named, metadata = gguf_tensors(cfg.model, tensors), gguf_metadata(cfg.model, name=cfg.name)
    try:
        return write_gguf(out / "model.gguf", named, metadata)
    except ValueError as e:  # a QArray GGML cannot hold (padded, tiled, ...)
        raise ConfigError(f"llama.cpp (GGUF): {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.export", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run directory written by experiments.train")
    p.add_argument("--plan", default=None, help="an autoquant plan (plan.json) to pack by")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument("--calibration", default=None,
                   help="a lowbit.ptq Calibration (JSON): static NVFP4 input scales")
    p.add_argument("--out", required=True, help="the directory to write")
    a = p.parse_args(argv)
    try:
        path = export(a.run, a.fmt, a.out, plan=a.plan, calibration=a.calibration)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
