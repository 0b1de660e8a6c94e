"""Serialization of QArrays and models. Depends on :mod:`lowbit.core.qarray` alone (no
recipes, no GEMMs, no Flax modules), so that every layer above can save and load what it holds:

- orbax checkpoints of QArray trees (:mod:`lowbit.io.checkpoint`) and the tree and manifest
  helpers they share (:mod:`lowbit.io.tree`);
- safetensors files and Hugging Face's sharded layout, raw tensors and QArrays
  (:mod:`lowbit.io.safetensors`);
- the serving formats, packed values written as they are, never requantized: GGUF for
  llama.cpp (:mod:`lowbit.io.gguf`), compressed-tensors for vLLM and transformers
  (:mod:`lowbit.io.compressed_tensors`), ModelOpt's Hugging Face export for TensorRT-LLM,
  vLLM and SGLang (:mod:`lowbit.io.modelopt`);
- exact rearrangements of packed weights for them (:mod:`lowbit.io.views`).
"""

from __future__ import annotations

from lowbit.io import checkpoint, compressed_tensors, modelopt, safetensors, tree, views
from lowbit.io.checkpoint import CheckpointError, restore, save
from lowbit.io.compressed_tensors import write_compressed_tensors
from lowbit.io.gguf import read_gguf, write_gguf
from lowbit.io.modelopt import write_modelopt
from lowbit.io.safetensors import read_safetensors, write_safetensors

__all__ = [
    "save",
    "restore",
    "CheckpointError",
    "read_safetensors",
    "write_safetensors",
    "read_gguf",
    "write_gguf",
    "write_compressed_tensors",
    "write_modelopt",
    "checkpoint",
    "compressed_tensors",
    "modelopt",
    "safetensors",
    "tree",
    "views",
]
