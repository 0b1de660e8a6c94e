"""Test configuration (tests and doctests): 4 fake CPU devices, strict rank promotion, a small
hypothesis profile for CI, and JAX's persistent compilation cache.

The cache (``.pytest_cache/jax-compilation/`` of the checkout; ``LOWBIT_TEST_JAX_CACHE=off``
disables it, any other value is the folder) is shared by the xdist workers: a computation
compiled twice in a session, such as the train step of a run and of its resumed second half,
compiles once (measured: the resume test 58 s -> 33 s from an empty cache). Tracing still runs
every time, so every warning and error raised while tracing is still seen; only XLA's
compilation of an identical program is skipped.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
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
