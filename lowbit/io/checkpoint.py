"""Checkpoints of packed (QArray) and float models with orbax-checkpoint.

Layout of a checkpoint directory::

    <path>/lowbit.json    manifest: every leaf's tree path, kind, shape, dtype, SHA-256, and
                          the static metadata of QArrays (format, original shape and axes)
    <path>/arrays/        an orbax StandardCheckpointer directory (OCDBT): one flat dict of
                          the arrays; QArray codes and E8M0 / E4M3 scales stay uint8

Saving writes to a temporary sibling directory and swaps it in with renames, so a failed save
leaves an existing checkpoint as it was; an existing path is only replaced when it is a lowbit
checkpoint. Restoring never writes, checks the manifest against the target (missing keys,
unexpected keys, shapes, dtypes, formats) and every array against its SHA-256, and raises
:class:`CheckpointError` naming what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import uuid
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.core.qarray import QArray
from lowbit.io import tree as trees

MANIFEST = "lowbit.json"
ARRAYS = "arrays"
VERSION = 1
_QFIELDS = ("codes", "scales", "tensor_scale")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or does not match what it is restored into."""


# --------------------------------------------------------------------------------------------
# save


def save(path: str | os.PathLike, tree: Any) -> pathlib.Path:
    """Save a pytree of arrays and QArrays (Linen params, an NNX ``State``, a packed tree).

    ``path`` is replaced atomically when it already holds a lowbit checkpoint (the new one is
    written next to it first); any other existing file or directory is an error.

    >>> import jax.numpy as jnp, lowbit.flax as lbf, tempfile, os
    >>> tree = lbf.pack({"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}, [(".*", "mxfp4")])
    >>> d = tempfile.mkdtemp()
    >>> _ = lbf.save(os.path.join(d, "ckpt"), tree)
    >>> lbf.restore(os.path.join(d, "ckpt"))["kernel"].format_name
    'mxfp4'
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    if path.exists() and not (path / MANIFEST).is_file():
        if not (path.is_dir() and not any(path.iterdir())):
            raise CheckpointError(
                f"refusing to replace {path}: it exists and is not a lowbit checkpoint "
                f"(no {MANIFEST})"
            )
    if any(c.__module__.startswith("flax.nnx") and c.__name__ == "Module"
           for c in type(tree).__mro__):  # an NNX model (flax itself is not imported here)
        raise TypeError("save the model's state: lowbit.flax.save(path, nnx.state(model))")
    flat, _ = trees.flatten(tree)
    leaves, arrays = [], {}
    for i, (entries, leaf) in enumerate(flat):
        leaves.append(_leaf_record(i, entries, leaf, arrays))
    manifest = {"format": "lowbit-flax-checkpoint", "version": VERSION, "leaves": leaves}

    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        with _quiet(), ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / ARRAYS, arrays)
            ckptr.wait_until_finished()
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Swap: the old checkpoint is moved aside, the new one moved in, the old one deleted.
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _leaf_record(i: int, entries: list, leaf, arrays: dict) -> dict:
    """The manifest record of leaf ``i``; its arrays go into ``arrays`` (orbax key -> array)."""
    name = trees.name(entries)
    rec: dict[str, Any] = {"path": entries}
    if trees.is_qarray(leaf):
        rec.update(
            kind="qarray",
            format=leaf.format_name,
            shape=list(leaf.shape),
            dtype=np.dtype(leaf.dtype).name,
            axes=list(leaf.axes),
            block_shape=list(leaf.block_shape),
            tensor_block=leaf.tensor_block,
            fields={},
        )
        for f in _QFIELDS:
            a = getattr(leaf, f)
            if a is None:
                continue
            key = f"a{i:05d}_{f}"
            if np.size(a) == 0:  # ternary's block scales: orbax stores no empty arrays,
                key = None  # the manifest's shape and dtype rebuild it
            else:
                arrays[key] = a
            rec["fields"][f] = {
                "key": key,
                "shape": list(np.shape(a)),
                "dtype": np.dtype(a.dtype).name,
                "sha256": trees.sha256(a),
            }
    elif (trees.is_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct)
          and trees.is_key(leaf)):
        # typed PRNG keys (NNX rng streams): stored as their key data
        key = f"a{i:05d}"
        data = jax.random.key_data(leaf)
        arrays[key] = data
        rec.update(
            kind="key",
            key=key,
            impl=str(jax.random.key_impl(leaf)),
            shape=list(np.shape(leaf)),
            dtype=trees.dtype_name(leaf),
            data_shape=list(np.shape(data)),
            data_dtype=np.dtype(data.dtype).name,
            sha256=trees.sha256(data),
        )
    elif trees.is_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
        key = f"a{i:05d}"
        arrays[key] = leaf
        rec.update(
            kind="array",
            key=key,
            shape=list(np.shape(leaf)),
            dtype=np.dtype(leaf.dtype).name,
            sha256=trees.sha256(leaf),
        )
    else:
        raise TypeError(f"save: leaf {name!r} is a {type(leaf).__name__}, not an array")
    return rec


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------------------------
# restore


def _read_manifest(path: pathlib.Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{path} is not a lowbit checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf} is corrupted or truncated (not valid JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "lowbit-flax-checkpoint":
        raise CheckpointError(f"{mf} is not a lowbit checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{mf}: checkpoint version {manifest.get('version')} is not supported "
            f"(this lowbit reads version {VERSION})"
        )
    if not (path / ARRAYS).is_dir():
        raise CheckpointError(f"checkpoint {path} is incomplete: {ARRAYS}/ is missing")
    return manifest


def _rec_describe(rec: dict) -> str:
    if rec["kind"] == "qarray":
        return (
            f"QArray({rec['format']}, shape={rec['shape']}, axes={rec['axes']}, "
            f"block_shape={rec['block_shape']})"
        )
    return f"{rec['dtype']}{rec['shape']}"


def _target_matches(rec: dict, leaf) -> bool:
    if trees.is_qarray(leaf):
        return (
            rec["kind"] == "qarray"
            and rec["format"] == leaf.format_name
            and tuple(rec["shape"]) == tuple(leaf.shape)
            and tuple(rec["axes"]) == tuple(leaf.axes)
            and tuple(rec["block_shape"]) == tuple(leaf.block_shape)
            and rec.get("tensor_block") == leaf.tensor_block
            and rec["dtype"] == np.dtype(leaf.dtype).name
        )
    if trees.is_key(leaf):
        return rec["kind"] == "key" and tuple(rec["shape"]) == tuple(np.shape(leaf))
    return (
        rec["kind"] == "array"
        and tuple(rec["shape"]) == tuple(np.shape(leaf))
        and rec["dtype"] == np.dtype(leaf.dtype).name
    )


def _sharding_of(x):
    s = getattr(x, "sharding", None)
    return s if isinstance(s, jax.sharding.Sharding) else None


def restore(path: str | os.PathLike, target: Any = None, *, verify: bool = True) -> Any:
    """Restore a checkpoint written by :func:`save`.

    Args:
      path: the checkpoint directory.
      target: None (return nested dicts, QArrays rebuilt), or a pytree with the expected
        structure (arrays, ``jax.ShapeDtypeStruct`` s, QArrays, an NNX ``State``): the
        checkpoint must match it key for key, shape for shape, and arrays are placed with
        its leaves' shardings. A packed target is ``jax.eval_shape(lambda p: pack(p, rules),
        params)``.
      verify: check every array against the SHA-256 recorded at save time.

    Raises:
      CheckpointError: no checkpoint, a corrupted / truncated file, a checksum mismatch, or
        a checkpoint that does not match ``target`` (the message lists what differs).

    >>> import jax.numpy as jnp, lowbit.flax as lbf, tempfile, os
    >>> path = lbf.save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"w": jnp.ones((4, 8))})
    >>> lbf.restore(path)["w"].shape
    (4, 8)
    >>> try:
    ...     lbf.restore(path, {"w": jnp.ones((4, 16))})
    ... except lbf.CheckpointError as e:
    ...     print(str(e).split("target: ")[1])
    shape/dtype/format mismatch: 'w': checkpoint has float32[4, 8], target expects float32[4, 16]
    """
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    manifest = _read_manifest(path)
    recs = manifest["leaves"]
    by_name = {trees.name(r["path"]): r for r in recs}
    target_leaves, treedef, names = None, None, None
    if target is not None:
        target_leaves, treedef, names = _check_target(path, by_name, target)
    abstract = _abstract_arrays(recs, target_leaves)
    try:
        with _quiet(), ocp.StandardCheckpointer() as ckptr:
            arrays = ckptr.restore(path / ARRAYS, abstract)
    except Exception as e:  # orbax / tensorstore errors vary; name the checkpoint
        raise CheckpointError(
            f"could not read the arrays of checkpoint {path} (truncated or corrupted files?): "
            f"{type(e).__name__}: {e}"
        ) from e

    def check(key, fr, what):
        if key is None and 0 in fr["shape"]:  # an empty field (save did not store it)
            return jnp.zeros(tuple(fr["shape"]), jnp.dtype(fr["dtype"]))
        a = arrays.get(key)
        if (
            a is None
            or tuple(a.shape) != tuple(fr["shape"])
            or np.dtype(a.dtype).name != fr["dtype"]
        ):
            raise CheckpointError(f"checkpoint {path}: {what} could not be read back intact")
        if verify and trees.sha256(a) != fr["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {what} is corrupted (SHA-256 differs from the one "
                "recorded at save time)"
            )
        return a

    built = {}
    for r in recs:
        name = trees.name(r["path"])
        if r["kind"] == "array":
            built[name] = check(r["key"], r, f"array {name!r}")
        elif r["kind"] == "key":
            fr = {"shape": r["data_shape"], "dtype": r["data_dtype"], "sha256": r["sha256"]}
            data = check(r["key"], fr, f"PRNG key {name!r}")
            built[name] = jax.random.wrap_key_data(data, impl=r["impl"])
        else:
            f = {k: check(fr["key"], fr, f"QArray {name!r} ({k})") for k, fr in r["fields"].items()}
            built[name] = QArray(
                codes=f["codes"],
                scales=f["scales"],
                tensor_scale=f.get("tensor_scale"),
                format_name=r["format"],
                shape=tuple(r["shape"]),
                dtype=jnp.dtype(r["dtype"]),
                axes=tuple(r["axes"]),
                block_shape=tuple(r["block_shape"]),
                tensor_block=r.get("tensor_block"),
            )
    if target is not None:
        return jax.tree_util.tree_unflatten(treedef, [built[n] for n in names])
    out: dict = {}
    for r in recs:
        node = out
        keys = [v for _, v in r["path"]]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if keys:
            node[keys[-1]] = built[trees.name(r["path"])]
        else:
            return built[trees.name(r["path"])]
    return out


def _check_target(path, by_name: dict, target):
    """(leaves by name, treedef, names) of ``target``; a CheckpointError naming what does
    not match the checkpoint's records."""
    flat, treedef = trees.flatten(target)
    names = [trees.name(e) for e, _ in flat]
    missing = [n for n in names if n not in by_name]
    unexpected = [n for n in by_name if n not in set(names)]
    mismatched = [
        f"{n!r}: checkpoint has {_rec_describe(by_name[n])}, target expects "
        f"{trees.describe_leaf(leaf)}"
        for n, (_, leaf) in zip(names, flat, strict=True)
        if n in by_name and not _target_matches(by_name[n], leaf)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the target: {unexpected}")
        if mismatched:
            parts.append("shape/dtype/format mismatch: " + "; ".join(mismatched))
        raise CheckpointError(
            f"checkpoint {path} does not match the target: " + " | ".join(parts)
        )
    target_leaves = {n: leaf for n, (_, leaf) in zip(names, flat, strict=True)}

    return target_leaves, treedef, names


def _abstract_arrays(recs: list, target_leaves: dict | None) -> dict:
    """What orbax restores: each stored array's shape, dtype and (the target's) sharding."""
    abstract = {}
    for r in recs:
        name = trees.name(r["path"])
        tleaf = target_leaves.get(name) if target_leaves is not None else None
        if r["kind"] == "array":
            abstract[r["key"]] = jax.ShapeDtypeStruct(
                tuple(r["shape"]), jnp.dtype(r["dtype"]), sharding=_leaf_sharding(tleaf)
            )
        elif r["kind"] == "key":
            abstract[r["key"]] = jax.ShapeDtypeStruct(
                tuple(r["data_shape"]), jnp.dtype(r["data_dtype"])
            )
        else:
            for f, fr in r["fields"].items():
                if fr["key"] is None:  # an empty field, not stored
                    continue
                sub = getattr(tleaf, f, None) if tleaf is not None else None
                abstract[fr["key"]] = jax.ShapeDtypeStruct(
                    tuple(fr["shape"]), jnp.dtype(fr["dtype"]), sharding=_leaf_sharding(sub)
                )
    return abstract


def _leaf_sharding(x):
    return _sharding_of(x) if x is not None else None
