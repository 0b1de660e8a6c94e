"""Serialization of QArrays and models: orbax checkpoints (:mod:`lowbit.io.checkpoint`) and
the tree and manifest helpers they share (:mod:`lowbit.io.tree`). Depends on
:mod:`lowbit.core.qarray` alone (no recipes, no GEMMs, no Flax modules), so that every layer above
can save and load what it holds; the export formats (safetensors, GGUF) belong here too."""

from __future__ import annotations

from lowbit.io import checkpoint, tree
from lowbit.io.checkpoint import CheckpointError, restore, save

__all__ = ["save", "restore", "CheckpointError", "checkpoint", "tree"]
