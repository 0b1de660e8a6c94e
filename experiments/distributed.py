"""Several processes, one run: ``jax.distributed`` for ``experiments.train`` and ``compare``.

JAX runs one SPMD program over the devices of every process; this module only starts it and
says which process writes files. One process per host (or per GPU), each started with the same
config and its own ``--process_id``::

    # host 0 (10.0.0.1) and host 1, the same command but --process_id=1
    python -m experiments.train --config configs/gpt.py:size=s,recipe=mxfp8 \\
        --coordinator=10.0.0.1:12355 --num_processes=2 --process_id=0

    # one machine, 2 processes x 2 CPU devices (collectives over gloo)
    for i in 0 1; do
      XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.train \\
        --config configs/gpt.py:size=tiny --coordinator=127.0.0.1:12355 \\
        --num_processes=2 --process_id=$i &
    done; wait

Under a cluster launcher that JAX recognises (SLURM's ``srun``, Open MPI's ``mpirun``, a
multi-host TPU pod slice) no flag is needed: :func:`initialize` calls
``jax.distributed.initialize()`` with no arguments and JAX reads the process count, ids and
coordinator from the launcher's environment.

What the training loop does with several processes (``experiments.trainer``): the mesh spans
every process's devices; each process draws the same global batch (the data position is one
number, the same everywhere) and hands JAX the rows its own devices hold; evaluation and the
metrics are global values, so every process sees the same numbers, and a non-finite loss stops
every process at the same step. Process 0 alone writes ``config.json``, ``metrics.jsonl``,
``summary.json`` and shows the progress bar; every process takes part in orbax's checkpoint
save and restore, so a run saved by N processes resumes under M (resharded onto M's mesh).

A process that dies: JAX's coordination service notices the missing heartbeats and terminates
the others (exit status 134, "the JAX distributed service detected fatal errors") within
``timeout_s`` (``--distributed_timeout``, default 60 s) instead of leaving them blocked in a
collective. The last complete checkpoint restores (orbax writes a step under a temporary name
and renames it when every process has written its part).
"""

from __future__ import annotations

import os
import re

import jax

# Environment variables by which JAX's own cluster detection recognises a launcher that started
# several processes (SLURM, Open MPI); a count of 1 means one process, nothing to initialize.
_LAUNCHERS = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


def launcher() -> str | None:
    """The cluster launcher that started several processes of this job, or None: SLURM
    (``SLURM_NTASKS``), Open MPI (``OMPI_COMM_WORLD_SIZE``) or a TPU pod slice of several hosts
    (``TPU_WORKER_HOSTNAMES``), the environments JAX's own cluster detection reads."""
    for var, name in _LAUNCHERS.items():
        try:
            if int(os.environ.get(var, "1")) > 1:
                return name
        except ValueError:
            continue
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    return None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 60,
) -> bool:
    """Join a multi-process run before anything else touches JAX's devices; True when this
    process is one of several.

    ``coordinator`` ("host:port" of process 0, which serves there), ``num_processes`` and
    ``process_id`` are given together, or not at all: then a launcher's environment
    (:func:`launcher`) starts ``jax.distributed`` with no arguments, and with neither the run
    is a single process. ``timeout_s``: how long a process waits for the others to join, and
    how long a dead process goes unnoticed before the others are terminated (JAX's heartbeat
    timeout). On CPU, collectives between processes run over gloo.

    >>> initialize()  # no flags, no launcher: one process
    False
    >>> initialize("localhost:1234", 2, 2)
    Traceback (most recent call last):
    ...
    ValueError: --process_id=2 must be in [0, 2) (--num_processes=2)
    """
    given = {
        "--coordinator": coordinator,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    if all(v is None for v in given.values()):
        if launcher() is None:
            return False
        _use_gloo()
        jax.distributed.initialize(
            initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s
        )
        return True
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} missing: pass --coordinator, --num_processes and "
            "--process_id together (or none of them under a cluster launcher)"
        )
    if not isinstance(coordinator, str) or not _ADDRESS.match(coordinator):
        raise ValueError(f"--coordinator={coordinator!r}: expected host:port of process 0")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"--num_processes={num_processes!r}: expected a positive integer")
    if (
        isinstance(process_id, bool)
        or not isinstance(process_id, int)
        or not 0 <= process_id < num_processes
    ):
        raise ValueError(
            f"--process_id={process_id!r} must be in [0, {num_processes}) "
            f"(--num_processes={num_processes})"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(f"--distributed_timeout={timeout_s!r}: expected a positive integer")
    if num_processes == 1:
        return False
    _use_gloo()
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=timeout_s,
    )
    return True


def define_flags():
    """Define ``--coordinator``, ``--num_processes``, ``--process_id`` and
    ``--distributed_timeout`` (absl) for a command-line entry point; returns a function that
    calls :func:`initialize` with their values (a bad value exits 1 naming the flag)."""
    import sys

    from absl import flags

    coordinator = flags.DEFINE_string("coordinator", None, "host:port of process 0")
    num = flags.DEFINE_integer("num_processes", None, "processes in the run")
    pid = flags.DEFINE_integer("process_id", None, "this process, 0 .. num_processes - 1")
    timeout = flags.DEFINE_integer(
        "distributed_timeout", 60, "seconds to wait for the others to join, or to notice one died"
    )

    def start() -> bool:
        try:
            return initialize(coordinator.value, num.value, pid.value, timeout_s=timeout.value)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)

    return start


def _use_gloo() -> None:
    # CPU collectives across processes (the GPU and TPU clients bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0; always, with one process)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches ``barrier(name)`` (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
