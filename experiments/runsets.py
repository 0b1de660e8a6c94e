"""Runs read back from ``runs/`` and grouped by what they trained: seeds of one experiment are
runs that differ in nothing but their seed.

A run's *identity* (:meth:`RunRecord.identity`) is its config.json, flattened to
``{"train.steps": 400, ...}``, without what names the run rather than what it trained
(``name``, ``workdir``, ``seed``, ``data.cache_dir``, the fields a resume may change), plus the
step it stopped at when it did not reach ``train.steps``; with

- ``quant.plan`` (a path) replaced by the plan's content hash (:func:`experiments.config.
  plan_identity`, from summary.json or the run's copy plan.json): an edited plan file is another
  plan, a moved one the same;
- ``init_from`` and ``train.distill_from`` that name a run of the same seed (``.../none-s0``
  for seed 0) read as ``.../none-s*``: the fine-tunes of seeds 0, 1, 2 of a float run are
  seeds of one fine-tune;
- keys missing from runs written before a field existed read as the value they had in effect
  (:data:`experiments.config.ADDED`) or the field's default.

It splits into the *setting* (model, data, training, ``init_from``, mesh: what a comparison of
recipes holds fixed) and the *treatment* (the ``quant`` section, distillation: what it varies).
:func:`group_seeds` pools runs of one identity and nothing else, labelled by what they trained
(:attr:`RunRecord.label`: the recipe, a plan's name), the label extended by the fields that
tell apart two treatments of one label (:func:`label_groups`); :func:`comparisons` splits runs
into comparisons (one folder of ``runs/``, one setting). What they leave out is returned, with
the reason, for the caller to say.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from experiments.config import (
    ADDED,
    RESUMABLE,
    MeshConfig,
    QuantConfig,
    TrainConfig,
    plan_identity,
    run_label,
)
from experiments.configlib import flatten
from experiments.families import DEFAULT_FAMILY, FAMILIES
from lowbit import autoquant

__all__ = ["RunRecord", "SeedGroup", "read_run", "read_runs", "group_seeds", "label_groups",
           "comparisons", "differing"]

# Keys of the identity that name the run rather than what it trained.
NOT_IDENTITY = {("name",), ("workdir",), ("seed",), ("data", "cache_dir"), *RESUMABLE}
# Top-level sections and keys of the treatment (the rest is the setting).
TREATMENT = ("quant.", "train.distill_")


def _defaults(family: str) -> dict[tuple, object]:
    """Every config key's default for ``family`` (what a key missing from an older run had)."""
    fam = FAMILIES.get(family, FAMILIES[DEFAULT_FAMILY])
    out: dict[tuple, object] = {}
    for section, cls in (("model", fam.model_config), ("data", fam.data_config),
                         ("train", TrainConfig), ("quant", QuantConfig), ("mesh", MeshConfig)):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[(section, f.name)] = list(f.default) if isinstance(f.default, tuple) \
                    else f.default
    return out


def _same_seed(path, seed: int):
    """A run directory named for ``seed`` (``.../none-s0``) as ``.../none-s*``."""
    if not path:
        return path
    return re.sub(rf"-s{seed}$", "-s*", str(path).rstrip("/"))


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run as written to disk: its directory, config.json and summary.json."""

    run_dir: Path
    config: dict
    summary: dict

    @property
    def seed(self) -> int:
        return int(self.summary.get("seed", self.config.get("seed", 0)))

    @property
    def folder(self) -> str:
        """The ``runs/`` folder the run is in (``gpt-tiny`` for ``runs/gpt-tiny/none-s0``)."""
        return self.run_dir.parent.name

    @property
    def plan(self) -> dict | None:
        """The :func:`~experiments.config.plan_identity` of the run's plan (None: no plan);
        for a run written before summaries carried it, from its copy plan.json."""
        if (self.config.get("quant") or {}).get("plan") is None:
            return None
        if "plan" in self.summary:
            return self.summary["plan"]
        copy = self.run_dir / "plan.json"
        return plan_identity(autoquant.Plan.load(copy)) if copy.exists() else {
            "name": "plan-unknown", "hash": None}

    @property
    def label(self) -> str:
        """What the run trained: its recipe, or its plan's name (+ the recipe)."""
        recipe = (self.config.get("quant") or {}).get("recipe", self.summary.get("recipe"))
        return run_label(recipe, self.plan)

    def identity(self) -> dict[str, object]:
        """Everything but the seed (see the module docstring), ``{"a.b": value}``."""
        family = self.config.get("family") or DEFAULT_FAMILY
        flat = {**_defaults(family), **ADDED, **flatten(self.config)}
        out = {}
        for key, v in flat.items():
            if key in NOT_IDENTITY:
                continue
            if key in (("init_from",), ("train", "distill_from")):
                v = _same_seed(v, self.seed)
            elif key == ("quant", "plan") and v is not None:
                v = (self.plan or {}).get("hash")
            if isinstance(v, float) and v.is_integer():
                v = int(v)  # 1.0 and 1 are one value
            out[".".join(key)] = json.dumps(v, sort_keys=True)  # hashable
        step = self.summary.get("step")
        if step != self.summary.get("steps", step):
            out["stopped_at"] = json.dumps(step)
        return dict(sorted(out.items()))

    def setting(self) -> dict[str, object]:
        """The identity's fields a comparison of recipes holds fixed."""
        return {k: v for k, v in self.identity().items() if not k.startswith(TREATMENT)}

    def treatment(self) -> dict[str, object]:
        """The identity's fields that say how it was quantized (and distilled)."""
        return {k: v for k, v in self.identity().items() if k.startswith(TREATMENT)}


def read_run(run_dir: str | os.PathLike) -> RunRecord:
    """The run in ``run_dir`` (ValueError naming what is missing or unreadable)."""
    d = Path(run_dir)
    try:
        config = json.loads((d / "config.json").read_text())
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{d}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict) or not isinstance(summary, dict):
        raise ValueError(f"{d}: config.json or summary.json is not an object")
    return RunRecord(d, config, summary)


def read_runs(root: str | os.PathLike) -> tuple[list[RunRecord], list[str]]:
    """The finished runs under ``root`` (``<root>/<folder>/<run>/``: a summary.json at its
    last step, with a final validation loss) and, for the other run directories (those with a
    config.json), ``"<dir>: <why>"``."""
    out, skipped = [], []
    for c in sorted(Path(root).glob("*/*/config.json")):
        if not (c.parent / "summary.json").exists():
            skipped.append(f"{c.parent}: no summary.json (not finished, or still running)")
            continue
        try:
            r = read_run(c.parent)
        except ValueError as e:
            skipped.append(str(e))
            continue
        step, steps = r.summary.get("step"), r.summary.get("steps")
        if step != steps:
            skipped.append(f"{r.run_dir}: stopped at step {step} of {steps}")
        elif r.summary.get("final_val_loss") is None:
            skipped.append(f"{r.run_dir}: no final validation loss")
        else:
            out.append(r)
    return out, skipped


@dataclasses.dataclass
class SeedGroup:
    """Runs of one identity (seeds of one experiment), labelled by what they trained."""

    label: str
    identity: dict[str, object]
    runs: list[RunRecord]


def group_seeds(records: Iterable[RunRecord]) -> tuple[list[SeedGroup], list[str]]:
    """Pool ``records`` by identity (everything but the seed), in the order first seen;
    a second run of one identity and seed is left out (``"<dir>: ..."`` in the second list).
    Labels are made unique with :func:`label_groups`.

    Runs that differ in their length, model, data, recipe (its version included), plan,
    distillation or start are never pooled."""
    groups: dict[str, SeedGroup] = {}
    skipped = []
    for r in records:
        ident = r.identity()
        key = json.dumps(ident, sort_keys=True)
        g = groups.setdefault(key, SeedGroup(r.label, ident, []))
        twin = next((o for o in g.runs if o.seed == r.seed), None)
        if twin is not None:
            skipped.append(f"{r.run_dir}: the same run and seed as {twin.run_dir}")
            continue
        g.runs.append(r)
    out = list(groups.values())
    label_groups(out)
    return out, skipped


def differing(identities: Sequence[dict[str, object]]) -> list[str]:
    """The keys whose values are not the same in all ``identities``."""
    keys = sorted({k for i in identities for k in i})
    return [k for k in keys if len({i.get(k) for i in identities}) > 1]


def _show(identity: dict, keys: Sequence[str], most: int = 4) -> str:
    def value(k):
        v = json.loads(identity[k]) if k in identity else None
        if isinstance(v, str) and os.sep in v:
            v = "/".join(Path(v).parts[-2:])  # a run directory: its folder and name
        return f"{k}={v if v != '' else repr(v)}"

    first = ("train.steps", "stopped_at", "init_from", "quant.recipe_version", "quant.plan")
    keys = sorted(keys, key=lambda k: (first.index(k) if k in first else len(first), k))
    shown = [value(k) for k in keys[:most]]
    return ", ".join(shown + ([f"+{len(keys) - most} more"] if len(keys) > most else []))


def label_groups(groups: list[SeedGroup]) -> None:
    """Give groups that share a label the fields that tell them apart:
    ``"qat_mxfp4 [train.distill_from=gpt-xs/none-s*]"`` (in place)."""
    by_label: dict[str, list[SeedGroup]] = {}
    for g in groups:
        by_label.setdefault(g.label, []).append(g)
    for same in by_label.values():
        if len(same) > 1:
            keys = differing([g.identity for g in same])
            for g in same:
                g.label = f"{g.label} [{_show(g.identity, keys)}]"


def comparisons(records: Iterable[RunRecord]) -> dict[str, list[RunRecord]]:
    """Runs split into comparisons: one ``runs/`` folder and one setting each, titled by the
    folder, with the setting's fields that differ from the folder's other settings when it
    has several (``"gpt-xs [init_from=gpt-xs/none-s*, train.steps=300]"``)."""
    by_folder: dict[str, dict[str, list[RunRecord]]] = {}
    for r in records:
        key = json.dumps(r.setting(), sort_keys=True)
        by_folder.setdefault(r.folder, {}).setdefault(key, []).append(r)
    out = {}
    for folder, settings in sorted(by_folder.items()):
        if len(settings) == 1:
            out[folder] = next(iter(settings.values()))
            continue
        idents = [rs[0].setting() for rs in settings.values()]
        keys = differing(idents)
        for ident, rs in zip(idents, settings.values(), strict=True):
            out[f"{folder} [{_show(ident, keys)}]"] = rs
    return out
