"""Compile for a GPU that is not there: XLA's whole CUDA pipeline for a device-less H100 or B200.

With the CUDA plugin installed (``pip install "jax[cuda12]==<jax's version>"``, what ``make
gpu-aot`` puts in its own virtual environment) and ``JAX_PLATFORMS=cpu``,
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`` gives a
topology of one GPU described by a target config (``targets/<name>.txtpb``) and
``jax.jit(f).lower(<ShapeDtypeStructs on that topology's mesh>).compile()`` runs every stage a
real GPU would: Pallas -> Triton IR -> Triton's passes -> LLVM -> PTX, and ``ptxas`` to SASS.
With ``xla_dump_to`` XLA keeps each module's PTX and its thunk sequence (every kernel launch
with its grid, threads and shared memory); the plugin's own ``ptxas -v`` (package
``nvidia-cuda-nvcc-cu12``) then reads each kernel's registers, spills and stack frame.

    with aot.session("h100") as t:                    # one target
        kernels, memory = t.compile(fn, *shape_dtype_structs)

:func:`compile_kernels` returns one :class:`KernelStats` per kernel launch of the compiled
module (Pallas kernels and XLA's own fusions alike; ``triton`` tells them apart) and the
compiled module's ``memory_analysis()``. Nothing here needs a GPU; everything here needs the
CUDA plugin (:func:`available` says whether it is installed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

__all__ = [
    "TARGETS",
    "Target",
    "KernelStats",
    "available",
    "ptxas_path",
    "parse_ptxas",
    "parse_thunks",
    "Session",
    "session",
]

_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Target:
    """A device-less GPU: its name, ``ptxas``'s ``--gpu-name`` and its target config file."""

    name: str
    arch: str  # ptxas --gpu-name (the architecture XLA's PTX targets)
    config_file: Path

    @property
    def config(self) -> str:
        return self.config_file.read_text()


TARGETS = {
    "h100": Target("h100", "sm_90a", _HERE / "targets" / "h100.txtpb"),
    "b200": Target("b200", "sm_100a", _HERE / "targets" / "b200.txtpb"),
}


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """One kernel launch of a compiled module: what ``ptxas -v`` and the thunk sequence say.

    ``registers`` per thread; ``spill_stores`` / ``spill_loads`` bytes per thread (0 and 0:
    no spills); ``stack`` the stack frame in bytes; ``shared_memory`` the bytes of shared
    memory the launch asks for (static and dynamic); ``grid`` and ``threads`` the launch
    dimensions; ``pallas``: a Pallas kernel (a ``pallas_call`` of the lowered module, by its
    name) rather than one of XLA's own fusions.
    """

    name: str
    pallas: bool
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def available() -> tuple[bool, str]:
    """Whether the CUDA plugin (and so XLA's GPU compiler and ``ptxas``) is installed, and why
    not."""
    if importlib.util.find_spec("jax_plugins") is None or not any(
        importlib.util.find_spec(m) is not None
        for m in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    ):
        return False, 'the CUDA plugin is not installed (pip install "jax[cuda12]==<jax version>")'
    if ptxas_path() is None:
        return False, "ptxas is not installed (pip install nvidia-cuda-nvcc-cu12)"
    return True, ""


def ptxas_path() -> Path | None:
    """The ``ptxas`` of the ``nvidia-cuda-nvcc`` wheel the CUDA plugin depends on (None if
    absent)."""
    for mod in ("nvidia.cuda_nvcc", "nvidia.cu13"):
        try:
            spec = importlib.util.find_spec(mod)
        except ModuleNotFoundError:
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            p = Path(root) / "bin" / "ptxas"
            if p.exists():
                return p
    return None


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """``ptxas -v``'s report: per entry function, its ``registers``, ``spill_stores``,
    ``spill_loads`` and ``stack`` (bytes per thread).

    >>> r = parse_ptxas('''ptxas info    : Compiling entry function 'k' for 'sm_90a'
    ... ptxas info    : Function properties for k
    ...     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
    ... ptxas info    : Used 255 registers, used 1 barriers''')
    >>> r["k"]
    {'stack': 8, 'spill_stores': 4, 'spill_loads': 12, 'registers': 255}
    """
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        if m := _PTXAS_FUNC.search(line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif current is not None and (m := _PTXAS_REGS.search(line)):
            current["registers"] = int(m.group(1))
            current = None
    return out


# a Pallas call of a lowered module: the Triton custom call, whose backend config names it
_PALLAS_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?\bname = "([^"]+)"')
_THUNK = re.compile(
    r"(kCustomKernel|kKernel)\s+(?:\[[^\]]*\]\s+)?(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]"
    r"\s+threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\](?:\s+shared_memory:\s*(\d+))?"
)


def parse_thunks(text: str) -> list[dict]:
    """Kernel launches of XLA's thunk sequence dump, in order: ``name``, ``grid``,
    ``threads``, ``shared_memory`` (bytes).

    >>> parse_thunks("001: kCustomKernel [source | sink] q grid: [512, 32, 1] "
    ...              "threads: [128, 1, 1]  shared_memory: 2048 bytes")[0]["grid"]
    (512, 32, 1)
    """
    out = []
    for line in text.splitlines():
        if m := _THUNK.search(line):
            g = tuple(int(v) for v in m.group(3, 4, 5))
            t = tuple(int(v) for v in m.group(6, 7, 8))
            out.append(dict(name=m.group(2), grid=g, threads=t,
                            shared_memory=int(m.group(9) or 0)))
    return out


class Session:
    """Compiles functions for one device-less :class:`Target` (see :func:`session`)."""

    def __init__(self, target: Target):
        from jax.experimental import topologies

        self.target = target
        topo = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=target.config
        )
        self.mesh = topologies.make_mesh(topo, (1,), ("d",))
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """An argument of ``shape`` and ``dtype`` on this target's one device."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def place(self, tree):
        """``tree``'s ``ShapeDtypeStruct`` leaves (or arrays) on this target's device."""
        return jax.tree.map(lambda x: self.spec(x.shape, x.dtype), tree)

    def compile(self, fn: Callable | jax.stages.Wrapped, *specs, **lower_kwargs):
        """Compile ``fn`` (jitted unless it is) for the target: ``(kernels, memory)``, the
        :class:`KernelStats` of every kernel launch and ``memory_analysis()``."""
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        lowered = jitted.lower(*specs, **lower_kwargs)
        pallas = set(_PALLAS_CALL.findall(lowered.as_text()))
        with tempfile.TemporaryDirectory(prefix="lowbit-aot-") as dump:
            compiled = lowered.compile({"xla_dump_to": dump})
            kernels = _read_dump(Path(dump), self.target, pallas)
        return kernels, compiled.memory_analysis()


@contextlib.contextmanager
def session(target: str | Target):
    """A :class:`Session` for ``target`` (a name of :data:`TARGETS` or a :class:`Target`);
    raises RuntimeError when the CUDA plugin is missing."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"pallas_kernels.aot needs XLA's GPU compiler: {why}")
    if isinstance(target, str):
        if target not in TARGETS:
            raise ValueError(f"target={target!r}: expected one of {sorted(TARGETS)}")
        target = TARGETS[target]
    yield Session(target)


def _read_dump(dump: Path, target: Target, pallas: set[str]) -> list[KernelStats]:
    """Every kernel launch of the module dumped in ``dump``, with ptxas's numbers."""
    thunks = []
    for f in sorted(dump.glob("*thunk_sequence.txt")):
        thunks += parse_thunks(f.read_text())
    regs: dict[str, dict[str, int]] = {}
    for ptx in sorted(dump.glob("*.ptx")):
        if ptx.stat().st_size == 0:
            continue
        regs.update(_ptxas(ptx, target.arch))
    out = []
    for t in thunks:
        r = regs.get(t["name"])
        if r is None:
            raise RuntimeError(f"kernel {t['name']} of the thunk sequence is in no PTX file")
        out.append(KernelStats(**t, **r, pallas=t["name"] in pallas))
    return out


def _ptxas(ptx: Path, arch: str) -> dict[str, dict[str, int]]:
    cmd = [str(ptxas_path()), "-v", "--gpu-name", arch, str(ptx), "-o", os.devnull]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {res.stderr[-2000:]}")
    return parse_ptxas(res.stderr + res.stdout)
