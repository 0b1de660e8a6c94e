"""Compile every Pallas kernel configuration and a training step for a device-less H100 and B200,
and report each kernel's registers, spills, shared memory and grid.

    make gpu-aot                         # its own venv (.venv-gpu, the CUDA plugin), then this
    .venv-gpu/bin/python -m benchmarks.gpu_aot [--targets h100,b200] [--no-steps]

What it compiles (``pallas_kernels.aot``: XLA's whole CUDA pipeline, Triton to PTX to SASS,
with no GPU):

- every configuration ``pallas_kernels.gpu_check`` runs, with the blocks it runs them with
  (``get_default``): quantize (every format, axis and rounding; the fused Hadamard cases; Four
  Over Six, double-block scales, MS-EDEN), the block-scaled matmul of every format pair and
  the weight-only ones on the prefill-like and decode-like shapes, and ``quantized_gemm``'s
  forward and backward GEMMs of its recipes end to end;
- one training step (``experiments.trainer.Trainer.step``: forward, backward, AdamW) of the
  ``s`` GPT under ``none``, ``mxfp8``, ``nvfp4`` and ``quartet`` with
  ``quant.implementation=pallas``, whose Pallas kernels are reported like the others and
  whose ``memory_analysis()`` gives what FQT costs in device memory (traced with no mesh in
  effect, so its GEMMs lower the Triton kernels);
- the Mosaic GPU matmuls (``pallas_kernels.quantized_gemm.mosaic``): ``quantized_gemm`` of
  both operands in each format its family takes, compiled under the target's mesh so that the
  dispatch picks the target's kernel as on that GPU (B200: ``blackwell_matmul``'s block-scaled
  ``tcgen05.mma``; H100: ``hopper_matmul``'s FP8 ``wgmma``), at the prefill-like and
  decode-like shapes; the MMA instructions of its PTX and ptxas's numbers from Mosaic GPU's
  own dump. Mosaic GPU runs ptxas for one target per process, so each target's are compiled
  in a fresh process (``--mosaic-child``). ``--mosaic-only`` compiles these alone and puts
  them into the existing report.

It writes ``pallas_kernels/aot_report.md`` (tables) and ``pallas_kernels/aot_report.json``
(the rows, read by ``tests/test_gpu_aot.py``: the configurations there must be those
``gpu_check`` runs and ``get_default`` returns, so the report cannot go stale silently) and
exits 1 when a configuration fails to compile or a Pallas kernel spills on either target.
XLA's own fusions in the training step are summarized (count, most registers, any spills),
not judged: their code is XLA's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot, gpu_check
from pallas_kernels.block_scaled_matmul.kernel import matmul_pallas
from pallas_kernels.grouped_matmul import check as grouped_check
from pallas_kernels.grouped_matmul.api import run_kernel as grouped_kernel
from pallas_kernels.quantized_gemm.kernel import kernel_configs
from pallas_kernels.quantized_gemm.mosaic import module, padded_sizes

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "pallas_kernels" / "aot_report.md"
REPORT_JSON = ROOT / "pallas_kernels" / "aot_report.json"
STEP_SIZE = "s"
STEP_RECIPES = ("none", "mxfp8", "nvfp4", "quartet")
MOSAIC_FAMILY = {"b200": "blackwell", "h100": "hopper"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One Pallas kernel launch of one compiled case on one target."""

    section: str  # "quantize", "matmul", "gemm" or "step"
    case: str
    kernel: str
    config: str
    target: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_memory: int
    grid: tuple[int, int, int]

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def _name(case) -> str:
    return " ".join(case.name.split())


def _gemm_role(kernel: str) -> str:
    """Which of a GEMM's kernels a launch is: its matmul, or the quantize kernel of ``a``
    (quantized along axis 1) or of ``b`` (along axis 0; NVFP4's amax pass included)."""
    if kernel.startswith("block_scaled_matmul"):
        return "matmul"
    return "a" if "_axis1" in kernel else "b"


def gemm_kernel_configs(case: gpu_check.GemmCase) -> dict:
    g = case.spec
    return kernel_configs(*case.mkn, g.lhs, g.rhs, g.hadamard or None)


def configurations() -> set[tuple[str, str]]:
    """``(case, configuration)`` of every kernel ``gpu_check`` runs, from its cases and
    ``get_default`` alone (nothing compiled): what the report must hold for each target."""
    out = {(_name(c), str(c.config)) for c in gpu_check.quantize_cases()}
    out |= {(_name(c), str(c.config)) for c in gpu_check.matmul_cases()}
    out |= {(_name(c), str(c.config)) for c in grouped_check.cases()}
    for c in gpu_check.gemm_cases():
        out |= {(_name(c), str(cfg)) for cfg in gemm_kernel_configs(c).values()}
    return out


def _compiled_cases(s: aot.Session):
    """``(section, case name, config of a kernel name, fn, specs)`` of every configuration."""
    key = jax.random.key(0)
    for c in gpu_check.quantize_cases():
        specs = (s.spec(c.shape, jnp.bfloat16), s.spec((2,), jnp.uint32))
        fn = lambda x, k, c=c: c.kernel(x, k, key, c.config)  # noqa: E731
        yield "quantize", _name(c), lambda _, c=c: str(c.config), fn, specs
    for c in gpu_check.matmul_cases():
        m, k, n = c.mkn
        specs = (s.place(gpu_check.operand_spec(c.a, (m, k), -1)),
                 s.place(gpu_check.operand_spec(c.b, (k, n), 0)))
        fn = lambda a, b, c=c: matmul_pallas(a, b, config=c.config,  # noqa: E731
                                             out_dtype=jnp.bfloat16)
        yield "matmul", _name(c), lambda _, c=c: str(c.config), fn, specs
    for c in grouped_check.cases():
        fn = lambda a, b, tg: grouped_kernel(a, b, tg, out_dtype=jnp.bfloat16)  # noqa: E731
        yield ("grouped", _name(c), lambda _, c=c: str(c.config), fn,
               s.place(grouped_check.specs(c)))
    for c in gpu_check.gemm_cases():
        cfgs = gemm_kernel_configs(c)
        yield ("gemm", _name(c), lambda kname, cfgs=cfgs: str(cfgs[_gemm_role(kname)]),
               c.call("pallas"), s.place(jax.eval_shape(c.args, key)))


def kernel_rows(s: aot.Session, failures: list) -> list[Row]:
    rows = []
    for section, name, config_of, fn, specs in _compiled_cases(s):
        try:
            kernels, _ = s.compile(fn, *specs)
        except Exception as e:  # one broken configuration should not hide the others
            failures.append(f"{s.target.name}: {name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows += [_row(section, name, config_of(k.name), s.target.name, k)
                 for k in kernels if k.pallas]
    return rows


def _row(section, case, config, target, k: aot.KernelStats) -> Row:
    return Row(section, case, k.name, config, target, k.registers, k.spill_stores,
               k.spill_loads, k.shared_memory, k.grid)


def _step_specs(s: aot.Session, recipe: str):
    """The ``s`` GPT's trainer under ``recipe`` (kernels on) and its step's arguments on the
    target's device."""
    from configs import gpt
    from experiments import trainer as tr
    from experiments.config import RunConfig

    c = gpt.get_config(f"size={STEP_SIZE},recipe={recipe}")
    c.quant.implementation = "pallas"
    cfg = RunConfig.from_config(c)
    mesh = jax.sharding.Mesh(np.asarray(s.mesh.devices).reshape(1, 1), tr.AXES)
    t = tr.Trainer(cfg, mesh)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         t.abstract, t.state_sharding)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=t.batch_sharding)
             for k in ("inputs", "targets")}
    return t, state, batch


def step_rows(s: aot.Session, recipe: str, failures: list):
    """The Pallas kernels of one training step (each distinct launch once), XLA's fusions
    summarized, and the step's memory: ``(rows, summary)``."""
    name = f"train step gpt-{STEP_SIZE} {recipe}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t, state, batch = _step_specs(s, recipe)
            kernels, mem = s.compile(t.step, state, batch)
    except Exception as e:
        failures.append(f"{s.target.name}: {name}: {type(e).__name__}: {str(e)[:300]}")
        return [], None
    seen, rows = set(), []
    for k in kernels:
        if k.pallas and (k.name, k.grid) not in seen:
            seen.add((k.name, k.grid))
            rows.append(_row("step", name, "get_default", s.target.name, k))
    xla = [k for k in kernels if not k.pallas]
    fallbacks = sorted({str(w.message).split(": ", 2)[-1] for w in caught
                        if "emulation instead of the kernels" in str(w.message)})
    summary = dict(
        recipe=recipe, target=s.target.name, pallas_launches=sum(k.pallas for k in kernels),
        xla_kernels=len(xla), xla_max_registers=max((k.registers for k in xla), default=0),
        xla_spilling=[f"{k.name} ({k.spill_stores}/{k.spill_loads} B)" for k in xla if k.spills],
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
        fallbacks=fallbacks,
    )
    return rows, summary


def kernel_module(target: str):
    """The Mosaic GPU kernel package that ``quantized_gemm`` dispatches to on ``target``."""
    return module(MOSAIC_FAMILY[target])


def mosaic_cases(target: str) -> list[tuple[str, int, int, int]]:
    """``(fmt, m, k, n)`` of every Mosaic GPU compile for ``target``: each format of its
    family's kernel, at ``gpu_check``'s prefill-like and decode-like shapes."""
    formats = kernel_module(target).FORMATS
    return [(fmt, *mkn) for mkn in (gpu_check.PREFILL, gpu_check.DECODE) for fmt in formats]


def expected_mma(target: str, fmt: str) -> str:
    """The MMA instruction a ``fmt`` kernel on ``target`` must hold in its PTX (a prefix)."""
    f = kernel_module(target).FORMATS[fmt]
    if target == "b200":
        return f"tcgen05.mma.cta_group::1.{f.ptx_kind}"
    return f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{f.ptx_type}.{f.ptx_type}"


def mosaic_config(target: str, fmt: str, m: int, k: int, n: int):
    """The blocks ``target``'s kernel runs a ``[m, k] x [k, n]`` GEMM in ``fmt`` with: its
    ``get_default`` at the sizes the wrapper pads to."""
    mp, kp, np_ = padded_sizes(MOSAIC_FAMILY[target], fmt, m, k, n)
    return kernel_module(target).get_default(fmt, mp, np_, kp)


def _mosaic_child(target: str) -> int:
    """Compile ``target``'s Mosaic GPU cases in this process; print their rows as JSON."""
    from pallas_kernels.quantized_gemm.mosaic_report import compile_gemm_report

    mod = kernel_module(target)
    rows, failures = [], []
    for fmt, m, k, n in mosaic_cases(target):
        case = f"mosaic gemm {fmt} MKN={(m, k, n)}"
        try:
            r = compile_gemm_report(fmt, m, k, n, target=target)
        except Exception as e:
            failures.append(f"{target}: {case}: {type(e).__name__}: {str(e)[:300]}")
            continue
        cfg = mosaic_config(target, fmt, m, k, n)
        rows.append(dict(
            section="mosaic", case=case, kernel=r["kernel"].split("_aot")[0], fmt=fmt,
            config=str(cfg), target=target, registers=r["registers"],
            spill_stores=r["spill_stores"], spill_loads=r["spill_loads"], stack=r["stack"],
            shared_memory=mod.smem_bytes(cfg, fmt), mma=r["mma"],
            expected_mma=expected_mma(target, fmt), xla_kernels=r["xla_kernels"],
            triton_kernels=r["triton_kernels"],
        ))
    print("MOSAIC " + json.dumps(dict(rows=rows, failures=failures)))
    return 0


def mosaic_rows(target: str, failures: list) -> list[dict]:
    """:func:`_mosaic_child` for ``target`` in a fresh process: its rows (its failures join
    ``failures``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_aot", "--mosaic-child", target],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("MOSAIC ")]
    if run.returncode or not lines:
        failures.append(f"{target}: the Mosaic GPU compiles: {run.stderr[-600:]}")
        return []
    out = json.loads(lines[-1].removeprefix("MOSAIC "))
    failures += out["failures"]
    return out["rows"]


def _spill_cell(r: dict) -> str:
    """A row's spills, ``stores/loads`` bytes, in bold where there are any."""
    spill = f"{r['spill_stores']}/{r['spill_loads']}"
    return f"**{spill}**" if r["spill_stores"] or r["spill_loads"] else spill


def mosaic_table(rows: list[dict]) -> str:
    lines = [
        "| case | kernel | configuration | target | MMA in the PTX | registers | spills (B, "
        "store/load) | shared memory (B) | Triton kernels beside it |",
        "|---|---|---|---|---|---:|---|---:|---:|",
    ]
    for r in rows:
        mma = "<br>".join(f"`{m}`" for m in r["mma"])
        lines.append(f"| {r['case']} | {r['kernel']} | {r['config']} | {r['target']} | {mma} "
                     f"| {r['registers']} | {_spill_cell(r)} | {r['shared_memory']} "
                     f"| {r['triton_kernels']} |")
    return "\n".join(lines) + "\n"


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def memory_table(steps: list[dict], target: str = "h100") -> str:
    """Device memory of the training step per recipe against ``none``."""
    base = next((d for d in steps if d["recipe"] == "none" and d["target"] == target), None)
    lines = [
        "| recipe | arguments (MiB) | outputs (MiB) | donated (MiB) | temporaries (MiB) | "
        "temporaries vs none | Pallas launches | GEMMs in the XLA emulation |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in steps:
        if d["target"] != target:
            continue
        rel = f"{d['temp_bytes'] / base['temp_bytes']:.2f}x" if base else "n/a"
        why = "; ".join(d["fallbacks"]) or "none"
        lines.append(
            f"| {d['recipe']} | {_mb(d['argument_bytes'])} | {_mb(d['output_bytes'])} | "
            f"{_mb(d['alias_bytes'])} | {_mb(d['temp_bytes'])} | {rel} | "
            f"{d['pallas_launches']} | {why} |"
        )
    return "\n".join(lines) + "\n"


def _kernel_table(rows: list[dict]) -> str:
    lines = [
        "| section | case | kernel | configuration | target | registers | spills (B, "
        "store/load) | shared memory (B) | grid |",
        "|---|---|---|---|---|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['section']} | {r['case']} | {r['kernel']} | {r['config']} | "
                     f"{r['target']} | {r['registers']} | {_spill_cell(r)} "
                     f"| {r['shared_memory']} | {list(r['grid'])} |")
    return "\n".join(lines) + "\n"


def render(data: dict) -> str:
    """The markdown report of the JSON report ``data``."""
    rows, steps, failures = data["rows"], data["steps"], data["failures"]
    mosaic = data.get("mosaic", [])
    spilling = [r for r in rows + mosaic if r["spill_stores"] or r["spill_loads"]]
    head = [
        "# Pallas kernels compiled for a device-less H100 and B200",
        "",
        f"Made by `make gpu-aot` (`python -m benchmarks.gpu_aot`) with jax {data['jax']} and "
        f"its CUDA plugin, targets {', '.join(data['targets'])} (`pallas_kernels/targets/`). "
        "Registers and spills per thread from `ptxas -v` on the PTX XLA generated; grid and "
        "shared memory from XLA's thunk sequence. Do not edit by hand: `tests/test_gpu_aot.py` "
        "checks that the configurations below are those `gpu_check` runs and `get_default` "
        "returns.",
        "",
        f"{len(rows)} Pallas kernel launches, {len(mosaic)} Mosaic GPU matmuls, "
        f"{len(spilling)} spilling, {len(failures)} compile failures.",
        "",
    ]
    head += [f"- FAILED: {f}" for f in failures]
    xla = [
        f"- {d['target']} {d['recipe']}: {d['xla_kernels']} XLA kernels, at most "
        f"{d['xla_max_registers']} registers, spilling: {', '.join(d['xla_spilling']) or 'none'}"
        for d in steps
    ]
    return "\n".join([
        *head,
        f"## Training step memory (GPT `{STEP_SIZE}`, H100)",
        "",
        "`compiled.memory_analysis()` of one step (forward, backward, AdamW; the state donated). "
        "Temporaries are every buffer XLA allocates inside the step, GEMM workspaces included.",
        "",
        memory_table(steps),
        "XLA's own kernels in the step (not judged here: their code is XLA's):",
        "",
        *xla,
        "",
        "## Mosaic GPU matmuls",
        "",
        "`quantized_gemm(..., implementation=\"pallas\")` with both operands in one format, "
        "compiled under each target's mesh, where the dispatch picks the target's Mosaic GPU "
        "kernel (B200: `blackwell_matmul`, H100: `hopper_matmul`); the operands' quantization "
        "runs in XLA around it. MMA instructions from Mosaic GPU's PTX, registers and spills "
        "from its `ptxas -v` log, shared memory from the kernel's scratch.",
        "",
        mosaic_table(mosaic),
        "## Kernels",
        "",
        _kernel_table(rows),
    ])


def write_report(data: dict) -> None:
    REPORT_JSON.write_text(json.dumps(data, indent=1) + "\n")
    REPORT.write_text(render(data))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="h100,b200", help="comma-separated aot.TARGETS")
    p.add_argument("--no-steps", action="store_true", help="skip the training steps")
    p.add_argument("--render", action="store_true",
                   help="only write the markdown again from the JSON report (no compiling)")
    p.add_argument("--mosaic-only", action="store_true",
                   help="compile the Mosaic GPU matmuls alone, into the existing report")
    p.add_argument("--mosaic-child", metavar="TARGET", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        REPORT.write_text(render(json.loads(REPORT_JSON.read_text())))
        return 0
    jax.config.update("jax_platforms", "cpu")  # the GPU is the device-less target, not a backend
    ok, why = aot.available()
    if not ok:
        print(f"gpu_aot: {why}; `make gpu-aot` installs it in .venv-gpu")
        return 2
    if args.mosaic_child:
        return _mosaic_child(args.mosaic_child)
    targets = args.targets.split(",")
    rows, steps, failures, mosaic = [], [], [], []
    t0 = time.perf_counter()
    for target in targets:
        mosaic += mosaic_rows(target, failures)
        print(f"{target}: Mosaic GPU matmuls compiled ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.mosaic_only:
        data = json.loads(REPORT_JSON.read_text())
        data["failures"] = [f for f in data["failures"] if "Mosaic" not in f] + failures
        write_report(data | dict(mosaic=mosaic))
        return _summary(mosaic, failures, t0)
    for target in targets:
        with aot.session(target) as s:
            rows += kernel_rows(s, failures)
            print(f"{target}: kernels compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
            for recipe in () if args.no_steps else STEP_RECIPES:
                r, summary = step_rows(s, recipe, failures)
                rows += r
                if summary is not None:
                    steps.append(summary)
                print(f"{target}: step {recipe} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = [dataclasses.asdict(r) for r in rows]
    write_report(dict(jax=jax.__version__, targets=targets, failures=failures, steps=steps,
                      rows=rows, mosaic=mosaic))
    return _summary(rows + mosaic, failures, t0)


def _summary(rows: list[dict], failures: list, t0: float) -> int:
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    for r in spilling:
        print(f"SPILLS: {r['target']} {r['case']} {r['kernel']} {r['config']}: "
              f"{r['spill_stores']}/{r['spill_loads']} B")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"{len(rows)} kernels: {len(spilling)} spilling, {len(failures)} failures; "
          f"{REPORT.relative_to(ROOT)} written ({time.perf_counter() - t0:.0f} s)")
    return 1 if spilling or failures else 0


if __name__ == "__main__":
    sys.exit(main())
