"""Test configuration (tests and doctests): 4 fake CPU devices, strict rank promotion, a small
hypothesis profile for CI, and JAX's persistent compilation cache.

The cache (``.pytest_cache/jax-compilation/`` of the checkout; ``LOWBIT_TEST_JAX_CACHE=off``
disables it, any other value is the folder) is shared by the xdist workers: a computation
compiled twice in a session, such as the train step of a run and of its resumed second half,
compiles once (measured: the resume test 58 s -> 33 s from an empty cache). Tracing still runs
every time, so every warning and error raised while tracing is still seen; only XLA's
compilation of an identical program is skipped.
"""

import gc
import os
import pathlib
import subprocess
import sys

# XLA:CPU compile flags for the suite, where compiling is most of the run time and every
# program runs on tiny arrays: LLVM's optimisation level 0 without its expensive passes, one
# codegen partition (the xdist workers already use every core), and XLA's classic elemental
# emitters instead of the newer fusion emitters, which compile slower. Measured on the whole
# suite, 2-core CPU, empty compile cache: 833 s wall and 23.6 min of CPU with the first two
# flags alone, 511 s and 14.1 min with all four. None of them changes what a computation means
# (IEEE float32 either way, no fast-math: the bit-exact comparisons with numpy references and
# with the C++ kernel hold under both settings); transcendental functions may differ in the
# last ulp from XLA's defaults, which no test compares against.
# ``LOWBIT_TEST_XLA_OPT=full`` keeps XLA's defaults (``make test-slow`` runs that way).
_FAST = [
    "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_llvm_disable_expensive_passes=true",
]


def _xla_accepts(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA knows ``flags`` (it aborts on an unknown flag, and flags come
    and go between releases): one short interpreter, once per session (the xdist workers
    inherit the environment this sets)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


_have = os.environ.get("XLA_FLAGS", "")
_FLAGS = ["--xla_force_host_platform_device_count=4"]
if os.environ.get("LOWBIT_TEST_XLA_OPT", "fast") != "full":
    _new = [f for f in _FAST if f.split("=")[0] not in _have]
    if _new and not _xla_accepts(_new):  # one is unknown to this XLA (jax 0.12 has no
        _new = [f for f in _new if _xla_accepts([f])]  # fusion-emitter switch): keep the rest
    _FLAGS += _new
os.environ["XLA_FLAGS"] = " ".join(
    [_have, *(f for f in _FLAGS if f.split("=")[0] not in _have)]
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

_cache = os.environ.get(
    "LOWBIT_TEST_JAX_CACHE",
    str(pathlib.Path(__file__).resolve().parent / ".pytest_cache" / "jax-compilation"),
)
if _cache != "off":
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile(
    "ci",
    max_examples=30,  # each example is a new shape, so a new compile; "thorough" runs 1000
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# XLA:CPU maps each compiled executable's code into the process (about nine memory mappings
# an executable, measured on jax 0.10.2 and 0.12), and an executable lives as long as the
# jitted function that cached it: a module-level ``jax.jit`` over many shapes keeps them all.
# An xdist worker running half the suite ended with 52,503 mappings (jax 0.12, 90% of the
# way), and at Linux's ``vm.max_map_count`` (65,530 by default) the next ``mmap`` inside XLA
# fails: a segfault or an abort wherever XLA maps code next, which is where an executable is
# compiled or loaded (seen inside the persistent compilation cache's write and read of a train
# step; reproduced alone: one jitted function compiled for 1,030 shapes, 63 mappings each,
# stops at 64,780 mappings with "LLVM compilation error: Cannot allocate memory" and a
# segfault in backend_compile_and_load). After a test module that leaves more than half the
# limit mapped, the jit caches are cleared (``jax.clear_caches``), which unmaps the executables
# nothing else holds; later modules recompile what they need (from the persistent cache where
# it has it).
def _max_map_count() -> int:
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 0


_MAP_BUDGET = _max_map_count() // 2


def memory_maps() -> int:
    """This process's memory mappings (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    yield
    if _MAP_BUDGET and memory_maps() > _MAP_BUDGET:
        jax.clear_caches()
        gc.collect()
