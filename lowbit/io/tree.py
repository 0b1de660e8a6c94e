"""Tree helpers of lowbit's serialization: QArrays as leaves, tree paths as names, the
manifest's descriptions of leaves (:mod:`lowbit.io.checkpoint` and the export formats use
them; so do ``lowbit.flax`` and ``lowbit.ptq`` to name parameters)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core.qarray import QArray

__all__ = [
    "is_qarray",
    "path_str",
    "keypath_str",
    "key_entry",
    "flatten",
    "name",
    "is_array",
    "sha256",
    "is_key",
    "dtype_name",
    "describe_leaf",
]


def is_qarray(x) -> bool:
    return isinstance(x, QArray)


def path_str(path: Iterable[Any]) -> str:
    """``("block", 0, "mlp")`` -> ``"block/0/mlp"``."""
    return "/".join(str(p) for p in path)


def keypath_str(keypath) -> tuple[str, ...]:
    """A jax key path as plain names (NNX Variables' ``.value`` dropped)."""
    out = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name not in ("value", "raw_value", "_raw_value"):
                out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(str(k.key))
        else:  # pragma: no cover - other key kinds
            out.append(str(k))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Flattening: (tree path, leaf) with QArrays as leaves


def key_entry(k) -> list:
    if isinstance(k, jax.tree_util.DictKey):
        return ["i", k.key] if isinstance(k.key, int) else ["s", str(k.key)]
    if isinstance(k, jax.tree_util.SequenceKey):
        return ["i", k.idx]
    if isinstance(k, jax.tree_util.GetAttrKey):
        return ["a", k.name]
    return ["s", str(k)]


def flatten(tree) -> tuple[list[tuple[list, Any]], Any]:
    """(path entries, leaf) pairs and the treedef; NNX Variables' ``.value`` dropped."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qarray)
    out = []
    for keypath, leaf in flat:
        entries = [key_entry(k) for k in keypath]
        entries = [e for e in entries if e != ["a", "value"]]
        out.append((entries, leaf))
    return out, treedef


def name(entries: list) -> str:
    return "/".join(str(v) for _, v in entries)


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def sha256(a) -> str:
    a = np.ascontiguousarray(np.asarray(jax.device_get(a)))
    return hashlib.sha256(a.view(np.uint8).reshape(-1).tobytes()).hexdigest()


def is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def dtype_name(x) -> str:
    """dtype name; typed PRNG keys (NNX rng streams) as ``key<impl>``."""
    if is_key(x):
        return (
            f"key<{jax.random.key_impl(x)}>"
            if not isinstance(x, jax.ShapeDtypeStruct)
            else str(x.dtype)
        )
    return np.dtype(x.dtype).name


def describe_leaf(x) -> str:
    if is_qarray(x):
        return (
            f"QArray({x.format_name}, shape={list(x.shape)}, axes={list(x.axes)}, "
            f"block_shape={list(x.block_shape)})"
        )
    return f"{dtype_name(x)}{list(np.shape(x))}"
