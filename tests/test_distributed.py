"""Multi-process training (experiments/distributed.py): 2 processes x 2 CPU devices on
localhost, collectives over gloo, against the same run in this process's 4 fake devices.

Each launch starts ``python -m experiments.train`` twice (process 0 and 1) on a free port,
waits a bounded time and always reaps both. The model is the smallest GPT the loop trains
(d 32, one layer, sequence 32), so a launch costs about two interpreter starts and compiles.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import checkpoints, distributed, metrics, trainer
from experiments.config import RunConfig
from experiments.configlib import load_config

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(gzip.decompress((ROOT / "tests/data/corpus.txt.gz").read_bytes()))
    return path


def settings(tmp: Path, corpus: Path, **train) -> dict:
    """The run's config fields (dotted), for the CLI and for this process alike."""
    s = {
        "data.path": str(corpus),
        "data.cache_dir": str(tmp / "cache"),
        "workdir": str(tmp / "runs"),
        "model.d_model": 32,
        "model.layers": 1,
        "model.heads": 2,
        "model.seq_len": 32,
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "train.steps": 8,
        "train.batch_size": 4,
        "train.lr": 1e-2,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "train.eval_every": 4,
        "train.eval_batches": 2,
        "train.checkpoint_every": 4,
        "train.progress": False,
    }
    s.update({f"train.{k}": v for k, v in train.items()})
    return s


def _set(c, s: dict) -> None:
    for k, v in s.items():
        *parents, leaf = k.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = v


def in_process(s: dict, resume: bool = False) -> trainer.RunResult:
    c = load_config(f"{ROOT / 'configs/gpt.py'}:size=tiny")
    _set(c, s)
    return trainer.train(RunConfig.from_config(c), resume=resume, log=lambda *_: None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(s: dict, *extra: str, timeout_s: int = 30) -> list[subprocess.Popen]:
    """Processes 0 and 1 of one run, 2 CPU devices each."""
    port = _free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {
        "PYTHONPATH": str(ROOT),
        "PATH": "/usr/bin:/bin",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=2", *flags]),
    }
    cmd = [sys.executable, "-m", "experiments.train", f"--config={ROOT}/configs/gpt.py:size=tiny"]
    cmd += [f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in s.items()]
    cmd += [f"--coordinator=127.0.0.1:{port}", "--num_processes=2"]
    cmd += [f"--distributed_timeout={timeout_s}", *extra]
    return [
        subprocess.Popen(
            [*cmd, f"--process_id={i}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def reap(procs: list[subprocess.Popen], timeout_s: float = LAUNCH_TIMEOUT_S):
    """Wait for every process (killing all of them past ``timeout_s``): [(rc, out, err)]."""
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def run_two(s: dict, *extra: str) -> list[tuple[int, str, str]]:
    done = reap(start(s, *extra))
    for i, (rc, _, err) in enumerate(done):
        assert rc == 0, f"process {i} exited {rc}: {err[-3000:]}"
    return done


def train_losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in metrics.read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "train"
    }


def test_two_processes_train_as_one_and_checkpoints_move_between_them(tmp_path, corpus):
    """Steps 1-4 in this process (4 devices), 5-8 in 2 processes x 2 devices resuming its
    checkpoint, 9-12 here again resuming theirs: the losses of the uninterrupted 1-process
    run, and one metrics file that reads as that run."""
    full = in_process(settings(tmp_path / "full", corpus, steps=12))
    s = settings(tmp_path / "moved", corpus, steps=12)
    first = in_process({**s, "train.stop_at": 4})  # saved by 1 process ...
    (_, out0, _), (_, out1, _) = run_two({**s, "train.stop_at": 8}, "--resume")  # ... by 2
    run_dir = tmp_path / "moved/runs/gpt-tiny/none-s0"
    # Process 0 alone reports and writes.
    assert "final validation loss" in out0 and "final validation loss" not in out1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4 and summary["step"] == 8
    middle = train_losses(run_dir)
    last = in_process({**s, "train.stop_at": 0}, resume=True)  # ... and resumed by 1
    # The same global batches and computation; only the summation order of cross-device
    # reductions may differ (float32), far below the step-to-step change of the loss (~0.1).
    got = [first.losses[k] for k in range(1, 5)] + [middle[k] for k in range(5, 9)]
    got += [last.losses[k] for k in range(9, 13)]
    np.testing.assert_allclose(got, [full.losses[k] for k in range(1, 13)], rtol=2e-4)
    np.testing.assert_allclose(last.final_val_loss, full.final_val_loss, rtol=2e-4)
    # Each record once, in order: the two processes wrote one file between them.
    steps = [(r["kind"], r["step"]) for r in metrics.read_metrics(run_dir / "metrics.jsonl")]
    assert steps == [(r["kind"], r["step"]) for r in metrics.read_metrics(full.metrics_path)]


def test_a_killed_process_stops_the_other_and_its_last_checkpoint_restores(tmp_path, corpus):
    s = settings(tmp_path, corpus, steps=100_000, eval_every=0, checkpoint_every=2)
    timeout_s = 5
    procs = start(s, timeout_s=timeout_s)
    ckpts = tmp_path / "runs/gpt-tiny/none-s0/checkpoints"
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (ckpts.is_dir() and sum(p.name.isdigit() for p in ckpts.iterdir()) >= 2):
            assert all(p.poll() is None for p in procs), reap(procs, 5)
            assert time.monotonic() < deadline, "no checkpoint was written in time"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        (rc0, _, err0), _ = reap(procs, timeout_s + 30)
        waited = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # Process 0 was not left blocked in a collective: JAX's coordination service ended it.
    assert rc0 != 0, err0[-2000:]
    assert waited < timeout_s + 30, waited
    # The newest complete checkpoint restores here (4 devices), its parameters finite.
    c = load_config(f"{ROOT / 'configs/gpt.py'}:size=tiny")
    _set(c, s)
    cfg = RunConfig.from_config(c)
    mngr = checkpoints.run_manager(cfg)
    step = int(mngr.latest_step())
    assert step >= 2 and (ckpts / str(step)).is_dir()
    tr = trainer.Trainer(cfg, trainer.make_mesh(cfg.mesh))
    state, data = checkpoints.restore(mngr, step, tr.abstract, tr.state_sharding)
    mngr.close()
    assert int(state["step"]) == step and data["position"] > 0, (state["step"], data)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_a_diverging_run_stops_every_process_at_the_same_step(tmp_path, corpus):
    # lr 0 at step 1 (warmup starts at 0), then 1e30 without clipping: parameters blow up.
    s = settings(tmp_path, corpus, lr=1e30, grad_clip=0.0, warmup_steps=4, checkpoint_every=1)
    done = reap(start(s))
    assert [rc for rc, _, _ in done] == [1, 1], [e[-2000:] for _, _, e in done]
    errors = [next(x for x in err.splitlines() if x.startswith("error: ")) for _, _, err in done]
    assert errors[0] == errors[1] and "non-finite parameters at step" in errors[0], errors


def test_flags_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="--num_processes, --process_id missing"):
        distributed.initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"--coordinator='nohost': expected host:port"):
        distributed.initialize("nohost", 2, 0)
    with pytest.raises(ValueError, match=r"--num_processes=0: expected a positive integer"):
        distributed.initialize("127.0.0.1:1234", 0, 0)
    with pytest.raises(ValueError, match=r"--distributed_timeout=0"):
        distributed.initialize("127.0.0.1:1234", 2, 1, timeout_s=0)
    assert distributed.initialize("127.0.0.1:1234", 1, 0) is False  # one process: nothing
    assert distributed.is_writer()


def test_launchers_are_recognised_from_their_environment(monkeypatch):
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.launcher() is None
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: nothing to join
    assert distributed.launcher() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.launcher() == "SLURM"
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert distributed.launcher() == "Open MPI"
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t0")
    assert distributed.launcher() is None
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t0,t1")
    assert distributed.launcher() == "TPU pod"
