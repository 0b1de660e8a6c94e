"""Checkpoints: bit-exact round trips (float and packed, Linen params and NNX state, sharded
restore); size on disk of a packed >= 1M-parameter model against bits x parameters; clear errors
for missing / mismatched / truncated / corrupted checkpoints that leave the files intact; a save
that fails leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit as lb
import lowbit.flax as lbf
from lowbit.flax import CheckpointError

RULES = [(r"up", "qat_mxfp4"), (r"down", "nvfp4")]

# A restore that fails on a damaged file leaves orbax's pending read coroutines to the garbage
# collector, which reports them (GeneratorExit) in whichever test runs next.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class MLP(nn.Module):
    width: int = 64
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.width, name="up", bias_init=self.bias_init)(x))
        return nn.Dense(32, name="down", bias_init=self.bias_init)(h)


@pytest.fixture(scope="module")
def params():
    return jax.jit(MLP().init)(jax.random.key(0), jnp.ones((2, 32)))["params"]


@pytest.fixture(scope="module")
def packed(params):
    return jax.jit(lambda p: lbf.pack(p, RULES))(params)


def _equal(a, b):
    """Bit-exact equality of two trees, QArrays compared field by field and by metadata."""
    la = jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, lb.QArray))
    lb_ = jax.tree.leaves(b, is_leaf=lambda x: isinstance(x, lb.QArray))
    assert jax.tree.structure(a, is_leaf=lambda x: isinstance(x, lb.QArray)) == jax.tree.structure(
        b, is_leaf=lambda x: isinstance(x, lb.QArray)
    )
    for u, v in zip(la, lb_, strict=True):
        if isinstance(u, lb.QArray):
            assert (u.format_name, u.shape, u.axes, u.block_shape, u.dtype) == (
                v.format_name,
                v.shape,
                v.axes,
                v.block_shape,
                v.dtype,
            )
            u, v = (u.codes, u.scales, u.tensor_scale), (v.codes, v.scales, v.tensor_scale)
        jax.tree.map(lambda s, t: np.testing.assert_array_equal(np.asarray(s), np.asarray(t)), u, v)


def _snapshot(path: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_roundtrip_float_and_packed(tmp_path, params, packed):
    lbf.save(tmp_path / "float", params)
    _equal(lbf.restore(tmp_path / "float"), params)
    lbf.save(tmp_path / "packed", packed)
    restored = lbf.restore(tmp_path / "packed")
    _equal(restored, packed)
    assert restored["up"]["kernel"].codes.dtype == jnp.uint8
    assert restored["down"]["kernel"].tensor_scale.dtype == jnp.float32
    # into an abstract packed target (what a serving job has before loading)
    target = jax.eval_shape(lambda p: lbf.pack(p, RULES), params)
    _equal(lbf.restore(tmp_path / "packed", target), packed)
    # and the packed model computes from the restored weights what it computed before
    serve = lbf.quantize(MLP(), RULES, packed=True)
    f = jax.jit(lambda p, x: serve.apply({"params": p}, x))
    x = jax.random.normal(jax.random.key(1), (4, 32))
    np.testing.assert_array_equal(f(restored, x), f(packed, x))


def test_roundtrip_nnx_state_sharded(tmp_path):
    model = nnx.Sequential(
        nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.Linear(128, 64, rngs=nnx.Rngs(1))
    )
    rules = [(r"layers/0", "qat_mxfp8"), (r"layers/1", "qat_nvfp4")]
    sites = lbf.sites(model, rules)
    state = jax.jit(lambda s: lbf.pack(s, rules, sites=sites))(nnx.state(model, nnx.Param))
    lbf.save(tmp_path / "ck", state)
    plain = lbf.restore(tmp_path / "ck")  # nested dicts, int keys kept
    assert set(plain["layers"]) == {0, 1}
    # restore into the model's own (float, sharded) structure: the packed target says how
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("model"))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape,
            a.dtype,
            sharding=sharding if a.ndim and a.shape[0] % 4 == 0 else NamedSharding(mesh, P()),
        ),
        jax.eval_shape(lambda: state),
    )
    restored = lbf.restore(tmp_path / "ck", target)
    assert isinstance(restored, nnx.State)
    codes = restored["layers"][0]["kernel"].get_value().codes
    assert codes.sharding == sharding and len(codes.sharding.device_set) == 4
    _equal(restored, state)


def _du_bytes(path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of a directory, as ``du`` reports them."""
    apparent = int(
        subprocess.run(
            ["du", "-sb", str(path)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    kib = int(
        subprocess.run(
            ["du", "-sk", str(path)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    return apparent, 1024 * kib


def test_packed_checkpoint_size_on_disk(tmp_path):
    """A >= 1M-parameter model packed with MXFP4: bytes on disk vs bits x parameters / 8.

    The bound is describe()'s total: 4.25 bits per quantized weight (E2M1 codes, two a byte,
    plus one E8M0 byte per 32), 32 per float32 bias. orbax compresses arrays (zstd), which
    only shrinks them (all-zero biases would nearly vanish; these are trained-like)."""
    model = MLP(width=16384, bias_init=nn.initializers.normal(0.02))  # 1.06 M parameters
    rules = [(r"up|down", "qat_mxfp4")]
    p = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 32)))["params"]
    packed = jax.jit(lambda p: lbf.pack(p, rules))(p)
    rows = lbf.describe(model, rules, jnp.ones((1, 32)), print_fn=None)
    n, bits = rows[-1].params, rows[-1].bits_per_param
    assert n >= 1_000_000
    bound = n * bits / 8
    lbf.save(tmp_path / "packed", packed)
    apparent, allocated = _du_bytes(tmp_path / "packed")
    held = lbf.packed_nbytes(packed)
    print(
        f"\npacked MXFP4 checkpoint of {n:,} parameters ({bits:.4f} bits/param): "
        f"bound {bound:,.0f} B; on disk {apparent:,} B apparent ({apparent / bound:.3f}x), "
        f"{allocated:,} B allocated ({allocated / bound:.3f}x); in memory {held:,} B"
    )
    assert abs(apparent / bound - 1) <= 0.10
    assert abs(allocated / bound - 1) <= 0.10
    lbf.save(tmp_path / "float", p)
    f_apparent, _ = _du_bytes(tmp_path / "float")
    print(f"float32 checkpoint: {f_apparent:,} B ({f_apparent / apparent:.2f}x the packed one)")
    assert f_apparent > 6 * apparent


def test_restore_mismatch_errors(tmp_path, params, packed):
    ck = tmp_path / "ck"
    lbf.save(ck, params)
    before = _snapshot(ck)
    wide = jax.eval_shape(MLP(width=128).init, jax.random.key(0), jnp.ones((2, 32)))["params"]
    with pytest.raises(
        CheckpointError,
        match=r"'up/kernel': checkpoint has float32\[32, 64\], "
        r"target expects float32\[32, 128\]",
    ):
        lbf.restore(ck, wide)
    extra = {**params, "extra": {"kernel": jnp.zeros((3, 3))}}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['extra/kernel'\]"):
        lbf.restore(ck, extra)
    with pytest.raises(
        CheckpointError,
        match=r"in the checkpoint but not in the target: "
        r"\['up/bias', 'up/kernel'\]",
    ):
        lbf.restore(ck, {"down": params["down"]})
    with pytest.raises(
        CheckpointError,
        match=r"'up/kernel': checkpoint has float32\[32, 64\], "
        r"target expects QArray\(mxfp4",
    ):
        lbf.restore(ck, packed)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        lbf.restore(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a lowbit checkpoint"):
        lbf.restore(tmp_path)
    assert _snapshot(ck) == before


def _largest_data_file(ck: pathlib.Path) -> pathlib.Path:
    files = [p for p in (ck / "arrays").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
    "damage", ["truncate_manifest", "truncate_data", "flip_byte", "delete_arrays"]
)
def test_restore_corrupted_errors(tmp_path, packed, damage):
    ck = tmp_path / "ck"
    lbf.save(ck, packed)
    if damage == "truncate_manifest":
        m = ck / "lowbit.json"
        m.write_bytes(m.read_bytes()[: m.stat().st_size // 2])
        match = "lowbit.json is corrupted or truncated"
    elif damage == "truncate_data":
        f = _largest_data_file(ck)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        match = r"could not read the arrays|is corrupted \(SHA-256"
    elif damage == "flip_byte":
        f = _largest_data_file(ck)
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
        match = r"could not read the arrays|is corrupted \(SHA-256"
    else:
        import shutil

        shutil.rmtree(ck / "arrays")
        match = "incomplete: arrays/ is missing"
    before = _snapshot(ck)
    with pytest.raises(CheckpointError, match=match):
        lbf.restore(ck)
    assert _snapshot(ck) == before  # a failed restore writes nothing


def test_failed_save_keeps_the_old_checkpoint(tmp_path, params, packed, monkeypatch):
    ck = tmp_path / "ck"
    lbf.save(ck, params)
    before = _snapshot(ck)

    def boom(self, *args, **kwargs):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as m:
        m.setattr(ocp.StandardCheckpointer, "save", boom)
        with pytest.raises(OSError, match="disk full"):
            lbf.save(ck, packed)
    assert _snapshot(ck) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory left behind
    with pytest.raises(TypeError, match="leaf 'up/kernel' is a str"):
        lbf.save(ck, {"up": {"kernel": "not an array"}})
    assert _snapshot(ck) == before
    # a successful save replaces it
    lbf.save(ck, packed)
    _equal(lbf.restore(ck), packed)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    # a directory that is not a lowbit checkpoint is never replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        lbf.save(other, params)
    assert (other / "notes.txt").read_text() == "keep me"


def test_nnx_full_state_with_quant_stream(tmp_path):
    """The whole NNX state (weights and the quant stream's key and counter) round-trips, so
    a resumed model draws the keys the uninterrupted one would."""

    def make(seed, quant):
        layer = nnx.Linear(32, 16, rngs=nnx.Rngs(seed))
        return lbf.quantize(layer, [(".*", "nvfp4")], rngs=nnx.Rngs(quant=quant))

    q = make(0, 3)
    q.dot_general.stream()  # one step taken: counter 1
    lbf.save(tmp_path / "s", nnx.state(q))
    resumed = make(9, 0)
    nnx.update(resumed, lbf.restore(tmp_path / "s", nnx.state(resumed)))
    np.testing.assert_array_equal(resumed.kernel[...], q.kernel[...])
    k_resumed, k_orig = resumed.dot_general.stream(), q.dot_general.stream()
    np.testing.assert_array_equal(jax.random.key_data(k_resumed), jax.random.key_data(k_orig))
