"""The config of a run: its sections as frozen dataclasses, and how two configs compare.

:class:`RunConfig` (built from a config file by :meth:`RunConfig.from_config`) holds the model
and data sections of its family (:mod:`experiments.families`), the training loop's
(:class:`TrainConfig`), the quantization's (:class:`QuantConfig`) and the device mesh's
(:class:`MeshConfig`). :func:`config_diff` names the fields that differ between two runs'
``config.json`` (what a ``--resume`` or a reuse must match); :func:`read_run_config` reads one.

Every linear layer not matched by ``quant.high_precision`` runs under ``quant.recipe``
through :func:`lowbit.flax.quantize` (the rules: :func:`quant_rules`).

A run says what it trained: under ``quant.plan`` (a saved :class:`lowbit.autoquant.PrecisionPlan`)
a config file's run ``<group>/<recipe>-s<seed>`` is named ``<group>/plan-<bits>b-<hash>-s<seed>``
(:func:`run_label`; the hash is of the plan's sites and recipes), and summary.json records
:func:`run_identity` (the label as ``recipe``, ``recipe_version``, the plan's
:func:`plan_identity`). Runs without a plan keep their names.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import ml_collections

import lowbit as lb
from experiments import data as data_lib
from experiments import vision
from experiments.configlib import ConfigError, to_dataclass, to_plain
from experiments.families import DEFAULT_FAMILY, FAMILIES, Family
from experiments.model import LLAMA_FIELDS, GPTConfig
from lowbit import autoquant
from lowbit.gemm.implementation import validate

__all__ = [
    "TrainConfig",
    "QuantConfig",
    "MeshConfig",
    "RunConfig",
    "family_of",
    "quant_rules",
    "config_diff",
    "RESUMABLE",
    "ADDED",
    "INIT_FROM_FREE",
    "EXPECTED_RUN",
    "check_run_dir",
    "read_run_config",
    "split_list",
    "fine_tune_config",
    "plan_identity",
    "run_label",
    "run_identity",
]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule and loop cadence (AdamW, linear warmup then cosine decay)."""

    steps: int = 100
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    log_every: int = 10
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 2
    stop_at: int = 0  # > 0: stop (with a checkpoint) after this step, as an interruption would
    progress: bool = True
    # Quantization-aware distillation (experiments/distill.py): the float teacher run ("" =
    # none), the softmax temperature and the distillation term's share of the loss.
    distill_from: str = ""
    distill_temperature: float = 1.0
    distill_weight: float = 1.0
    # Set by --extend (experiments/extend.py): the train.steps the run had before each
    # extension. The learning-rate schedule (and a quant.switch_fraction) stays laid over the
    # first (``schedule_steps``); past it the lr holds its final value, lr * min_lr_ratio. (A
    # fresh run given it trains the steps the extended run does: tests check the extension so.)
    extended_from: tuple[int, ...] = ()

    @property
    def schedule_steps(self) -> int:
        """The steps the learning-rate schedule decays over: ``steps``, or for an extended run
        its original length (``extended_from[0]``)."""
        return self.extended_from[0] if self.extended_from else self.steps

    def __post_init__(self):
        for f in ("steps", "batch_size", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self, f) < 1:
                raise ValueError(f"train.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("eval_every", "checkpoint_every"):
            if getattr(self, f) < 0:
                raise ValueError(
                    f"train.{f} must be >= 0 (0: only at the end), got {getattr(self, f)}"
                )
        ext = self.extended_from
        if any(not isinstance(n, int) or n < 1 for n in ext) or list(ext) != sorted(set(ext)) \
                or (ext and ext[-1] >= self.steps):
            raise ValueError(f"train.extended_from must be increasing step counts below "
                             f"steps={self.steps}, got {ext}")
        if not 0 <= self.warmup_steps < self.schedule_steps:  # the cosine decay needs a step
            raise ValueError(
                f"train.warmup_steps must be in [0, steps - 1], got {self.warmup_steps} with "
                f"steps={self.schedule_steps}"
            )
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if not 0 <= self.stop_at <= self.steps:
            raise ValueError(f"train.stop_at must be in [0, steps], got {self.stop_at}")
        if not isinstance(self.distill_from, str | os.PathLike):
            raise ValueError(
                f'train.distill_from: expected a run directory (a path) or "", got '
                f"{self.distill_from!r}"
            )
        if not self.distill_temperature > 0:
            raise ValueError(
                f"train.distill_temperature must be > 0, got {self.distill_temperature}")
        if not 0 <= self.distill_weight <= 1:
            raise ValueError(f"train.distill_weight must be in [0, 1] (the distillation term's "
                             f"share of the loss), got {self.distill_weight}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Which recipe the model's linear layers train under, which modules stay float, and how
    the quantized GEMMs run: ``implementation`` is ``lowbit.dot_general``'s (None: the best
    for the backend, ``"xla"``: the pure-XLA emulation, ``"pallas"``: the Pallas kernels when
    lowered for CUDA), passed to :func:`lowbit.flax.quantize`."""

    recipe: str = "none"
    high_precision: str = r"embed|pos_embed|head|.*/router"
    implementation: str | None = None
    # A saved lowbit.autoquant.Plan (JSON; None: no plan): its sites get their planned recipes
    # ("none" included) before high_precision and recipe apply. Stored as an absolute path.
    plan: str | None = None
    # The recipe's definition version (lowbit.gemm.recipes.Recipe.version), filled in: recorded in
    # config.json, so a run of an older definition of a recipe is not reused or resumed as one
    # of the current definition (runs written before the field existed read as version 1).
    recipe_version: int | None = None
    # TetraJet-v2's OsciReset (lowbit.flax.training.osci_reset): every osci_period steps (0:
    # off; from step osci_start, a multiple of it) track osci_window steps and reset the
    # weights whose quantized value travelled >= osci_threshold times as far as they did.
    osci_period: int = 0
    osci_window: int = 50
    osci_threshold: float = 16.0
    osci_start: int = 0
    # TetraJet-v2's OutControl (lowbit.flax.training.out_control): record input-channel norms
    # for out_control_steps steps after step out_control_start, then run the top out_control
    # (a ratio; 0: off) of each site's channels, rounded up to out_control_multiple, in MXFP8.
    out_control: float = 0.0
    out_control_start: int = 1
    out_control_steps: int = 10
    out_control_multiple: int = 128
    # A precision schedule: switch the recipe to switch_to (None: never) at step switch_step,
    # at switch_fraction of train.steps, or by switch_criterion ("grad_noise": FP4 All the
    # Way's, checked every switch_check_every steps); exactly one of the three.
    switch_to: str | None = None
    switch_step: int = 0
    switch_fraction: float = 0.0
    switch_criterion: str = ""
    switch_check_every: int = 10

    def __post_init__(self):
        try:
            r = lb.recipes.get(self.recipe)
        except (ValueError, KeyError) as e:
            raise ValueError(f"quant.recipe: {e}") from None
        self._check_training_state()
        if self.recipe_version is None:
            object.__setattr__(self, "recipe_version", r.version)
        validate(self.implementation, "quant.implementation")
        if self.plan is not None:
            if not isinstance(self.plan, str | os.PathLike) or not str(self.plan):
                raise ValueError(
                    f"quant.plan: expected a plan file (a path) or None, got {self.plan!r}"
                )
            path = str(Path(self.plan).expanduser().resolve())
            try:
                autoquant.Plan.load(path)
            except (OSError, ValueError) as e:
                raise ValueError(f"quant.plan={str(self.plan)!r}: {e}") from None
            object.__setattr__(self, "plan", path)  # resolved once, as init_from is

    def _check_training_state(self) -> None:
        if self.osci_period < 0:
            raise ValueError(f"quant.osci_period must be >= 0 (0: off), got {self.osci_period}")
        if self.osci_period:
            if self.osci_window < 1 or self.osci_period < self.osci_window + 2:
                raise ValueError(
                    f"quant.osci_window must be in [1, osci_period - 2], got "
                    f"{self.osci_window} with osci_period={self.osci_period}"
                )
            if not self.osci_threshold > 0:
                raise ValueError(f"quant.osci_threshold must be > 0, got {self.osci_threshold}")
            if self.osci_start < 0 or self.osci_start % self.osci_period:
                raise ValueError(
                    f"quant.osci_start must be a multiple of osci_period={self.osci_period}, "
                    f"got {self.osci_start}"
                )
        if not 0 <= self.out_control < 1:
            raise ValueError(
                f"quant.out_control must be a ratio in [0, 1) (0: off), got {self.out_control}"
            )
        if self.out_control:
            if self.out_control_start < 0 or self.out_control_steps < 1:
                raise ValueError(
                    f"quant.out_control_start must be >= 0 and out_control_steps >= 1, got "
                    f"{self.out_control_start} and {self.out_control_steps}"
                )
            if self.out_control_multiple < 32 or self.out_control_multiple % 32:
                raise ValueError(
                    "quant.out_control_multiple must be a positive multiple of 32, got "
                    f"{self.out_control_multiple}"
                )
        if self.switch_to is None:
            if self.switch_step or self.switch_fraction or self.switch_criterion:
                raise ValueError(
                    "quant.switch_step / switch_fraction / switch_criterion need quant.switch_to "
                    "(the recipe to switch to)"
                )
            return
        try:
            lb.recipes.get(self.switch_to)
        except (ValueError, KeyError) as e:
            raise ValueError(f"quant.switch_to: {e}") from None
        given = [n for n, v in (("switch_step", self.switch_step),
                                ("switch_fraction", self.switch_fraction),
                                ("switch_criterion", self.switch_criterion)) if v]
        if len(given) != 1:
            raise ValueError(
                "quant.switch_to needs exactly one of quant.switch_step, switch_fraction, "
                f"switch_criterion; got {given or 'none'}"
            )
        if self.switch_step < 0:
            raise ValueError(f"quant.switch_step must be >= 1, got {self.switch_step}")
        if not 0 <= self.switch_fraction < 1:
            raise ValueError(
                f"quant.switch_fraction must be in (0, 1), got {self.switch_fraction}"
            )
        if self.switch_criterion not in ("", "grad_noise"):
            raise ValueError(
                f"quant.switch_criterion: expected 'grad_noise', got {self.switch_criterion!r}"
            )
        if self.switch_check_every < 1:
            raise ValueError(
                f"quant.switch_check_every must be >= 1, got {self.switch_check_every}"
            )
        if self.plan is not None:
            raise ValueError("quant.switch_to with quant.plan: a plan's recipes do not switch")

    def recipes(self) -> list:
        """Every recipe the rules use: ``recipe`` and the plan's."""
        out = [lb.recipes.get(self.recipe)]
        if self.plan is not None:
            out += list(autoquant.Plan.load(self.plan).recipes.values())
        return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape: ``data`` x ``fsdp`` (``data=-1``: the devices left over)."""

    data: int = -1
    fsdp: int = 1


def family_of(cfg: RunConfig) -> Family:
    """The :class:`experiments.families.Family` of ``cfg.family``."""
    return FAMILIES[cfg.family]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str
    model: GPTConfig | vision.ViTConfig  # the family's model config
    data: data_lib.DataConfig | vision.DigitsDataConfig  # the family's data config
    train: TrainConfig
    quant: QuantConfig
    mesh: MeshConfig = MeshConfig()
    seed: int = 0
    workdir: str = "runs"
    # A run directory whose latest checkpoint's parameters this run starts from ("" = the
    # random init); stored resolved to an absolute path. See the module docstring.
    init_from: str = ""
    # The model family, a key of FAMILIES: which model, data, loss and metrics.
    family: str = DEFAULT_FAMILY
    # A Hugging Face directory of a Llama-family checkpoint (experiments.hf) this run starts
    # from ("" = none): its config.json replaces the model section (model.dtype kept), its
    # weights the random init; stored resolved to an absolute path.
    init_from_hf: str = ""

    @classmethod
    def from_config(cls, c) -> RunConfig:
        """From a ConfigDict such as ``configs/gpt.py``'s or ``configs/digits.py``'s, or the
        dict of a run's config.json (dtype ``auto`` resolved here)."""
        saved = isinstance(c, dict)  # a run's config.json keeps the name it was written under
        c = to_plain(c)
        known = {"name", "model", "data", "train", "quant", "mesh", "seed", "workdir"}
        known |= {"init_from", "family", "init_from_hf"}
        unknown = sorted(set(c) - known)
        if unknown:
            raise ConfigError(f"config: unknown key(s) {unknown}; expected {sorted(known)}")
        family = c.get("family") or DEFAULT_FAMILY
        if family not in FAMILIES:
            raise ConfigError(f"config.family={family!r}: expected one of {sorted(FAMILIES)}")
        fam = FAMILIES[family]
        model = dict(c.get("model", {}))
        if model.get("dtype", "float32") == "auto":
            model["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        hf_dir = c.get("init_from_hf") or ""
        cfg = cls(
            name=str(c.get("name", "run")),
            model=(_hf_model(hf_dir, family, model.get("dtype", "float32")) if hf_dir
                   else to_dataclass(fam.model_config, model, "model")),
            data=to_dataclass(fam.data_config, c.get("data"), "data"),
            train=to_dataclass(TrainConfig, c.get("train"), "train"),
            quant=to_dataclass(QuantConfig, c.get("quant"), "quant"),
            mesh=to_dataclass(MeshConfig, c.get("mesh"), "mesh"),
            seed=int(c.get("seed", 0)),
            workdir=str(c.get("workdir", "runs")),
            init_from=c.get("init_from") or "",
            family=family,
            init_from_hf=hf_dir,
        )
        return cfg if saved else _named_for_plan(cfg)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"config.family={self.family!r}: expected one of {sorted(FAMILIES)}")
        fam = FAMILIES[self.family]
        for section, want in (("model", fam.model_config), ("data", fam.data_config)):
            if not isinstance(getattr(self, section), want):
                raise ConfigError(
                    f"config.{section}: family {self.family!r} takes a {want.__name__}, got "
                    f"{type(getattr(self, section)).__name__}"
                )
        check_hadamard_fits(self)
        if not isinstance(self.init_from, str | os.PathLike):
            raise ConfigError(
                f'config.init_from: expected a run directory (a path) or "", got {self.init_from!r}'
            )
        if self.init_from:  # resolved once, so config.json and --resume compare one path
            object.__setattr__(self, "init_from", str(Path(self.init_from).expanduser().resolve()))
        if self.init_from_hf:
            if self.init_from or self.train.distill_from:
                raise ConfigError("config.init_from_hf with init_from or train.distill_from: a "
                                  "run starts from one checkpoint")
            object.__setattr__(self, "init_from_hf",
                               str(Path(self.init_from_hf).expanduser().resolve()))
        if self.train.distill_from:  # QAD: the teacher is the checkpoint the student starts from
            teacher = str(Path(self.train.distill_from).expanduser().resolve())
            object.__setattr__(self, "train",
                               dataclasses.replace(self.train, distill_from=teacher))
            if not self.init_from:
                object.__setattr__(self, "init_from", teacher)
            elif self.init_from != teacher:
                raise ConfigError(
                    f"config.train.distill_from={teacher!r} and init_from={self.init_from!r} "
                    "differ: the student starts from its teacher (leave init_from empty)"
                )
            if self.quant.switch_to is not None:
                raise ConfigError("config.train.distill_from with quant.switch_to: a precision "
                                  "schedule under distillation is not supported")

    @property
    def run_dir(self) -> Path:
        return Path(self.workdir) / self.name

    def to_json(self) -> dict:
        return to_plain(self)


def _hf_model(path, family: str, dtype: str) -> GPTConfig:
    """The model section of a run that starts from the Hugging Face checkpoint ``path``."""
    from experiments import hf

    if family != "gpt":
        raise ConfigError(f"config.init_from_hf: family {family!r}; Hugging Face checkpoints "
                          "load into the gpt family")
    cfg_file = Path(path).expanduser() / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"config.init_from_hf={str(path)!r}: no config.json there (expected a "
                          "Hugging Face model directory: config.json and model.safetensors)")
    try:
        model = hf.gpt_config(json.loads(cfg_file.read_text()), dtype=dtype,
                              where=f"config.init_from_hf: {cfg_file}")
    except hf.UnsupportedCheckpoint as e:
        raise ConfigError(str(e)) from None
    if model.vocab < data_lib.VOCAB_SIZE:
        raise ConfigError(f"config.init_from_hf: the checkpoint's vocab_size={model.vocab} is "
                          f"below the byte data's {data_lib.VOCAB_SIZE} token ids")
    return model


def check_hadamard_fits(cfg: RunConfig) -> None:
    """A recipe's Hadamard blocks must divide the contraction axes they run along: features
    (forward, input gradient) and the tokens (weight gradient): the sequence of a GPT
    (``model.seq_len``), the patch tokens of a ViT's batch (``train.batch_size *
    model.num_patches``, its linear layers seeing ``[batch * patches, features]``)."""
    q = cfg.quant
    feature_axes, token_axes = family_of(cfg).contraction_axes(cfg)
    for r in q.recipes():
        feats = [g.hadamard for g in (r.fwd, r.dlhs) if g.hadamard]
        tokens = r.drhs.hadamard
        checks = [(h, name, n) for name, n in feature_axes for h in feats]
        if tokens:
            checks += [(tokens, name, n) for name, n in token_axes]
        where = "quant.recipe" if r.name == q.recipe else "quant.plan's recipe"
        for h, name, n in checks:
            if n % h:
                raise ConfigError(
                    f"{where}={r.name!r} applies Hadamard transforms of {h} along GEMM "
                    f"contraction axes: {name}={n} must be a multiple of {h}"
                )


# Fields that may differ between a run and its resumption (they do not change the numbers).
RESUMABLE = {("train", "stop_at"), ("train", "progress"), ("train", "keep_checkpoints")}
# Fields added after runs were written with no value for them, and the value those runs had in
# effect (config_diff reads a missing key as this instead of None).
ADDED = {
    ("init_from",): "",
    ("init_from_hf",): "",
    ("family",): DEFAULT_FAMILY,
    ("quant", "recipe_version"): 1,
    ("train", "distill_from"): "",
    ("train", "distill_temperature"): 1.0,
    ("train", "distill_weight"): 1.0,
    ("train", "extended_from"): [],
    **{("quant", f.name): f.default for f in dataclasses.fields(QuantConfig)
       if f.name.startswith(("osci_", "out_control", "switch_"))},
    **{("model", f.name): f.default for f in dataclasses.fields(GPTConfig)
       if f.name in LLAMA_FIELDS},
}
# Model fields an init_from run may change: they do not change the parameters.
INIT_FROM_FREE = {"dtype"}


def plan_identity(plan: autoquant.PrecisionPlan) -> dict:
    """What a plan trains, as a run's summary.json records it: ``name`` (``plan-<bits>b-<hash>``,
    the run's label), ``hash`` (of its sites, their members and recipes: the part that changes
    the numbers), its ``bits`` per parameter, ``budget``, ``cost``, ``method`` and ``counts``
    (sites per recipe)."""
    d = plan.to_json()
    what = json.dumps({k: d[k] for k in ("choices", "members", "recipes")}, sort_keys=True)
    digest = hashlib.sha256(what.encode()).hexdigest()[:8]
    return {"name": f"plan-{plan.bits:.2f}b-{digest}", "hash": digest, "bits": plan.bits,
            "budget": plan.budget, "cost": plan.cost, "method": plan.method,
            "counts": plan.counts()}


def run_label(recipe: str, plan: dict | None) -> str:
    """What a run trained under, as its name and summary say: the recipe; under a plan (a
    :func:`plan_identity`) the plan's name, ``+<recipe>`` when the sites it leaves out are
    quantized.

    >>> run_label("mxfp4", None), run_label("none", {"name": "plan-4.50b-0123abcd"})
    ('mxfp4', 'plan-4.50b-0123abcd')
    """
    if plan is None:
        return recipe
    return plan["name"] if recipe == "none" else f"{plan['name']}+{recipe}"


def run_identity(cfg: RunConfig) -> dict:
    """The summary.json fields that say what a run of ``cfg`` trained: ``recipe`` (its
    :func:`run_label`), ``recipe_version``, ``plan`` (:func:`plan_identity` of the plan copy in
    the run directory, else of ``quant.plan``) and ``extended_from`` where they apply."""
    q, out = cfg.quant, {}
    if q.plan is not None:
        copy_ = cfg.run_dir / "plan.json"
        out["plan"] = plan_identity(autoquant.Plan.load(copy_ if copy_.exists() else q.plan))
    out = {"recipe": run_label(q.recipe, out.get("plan")), "recipe_version": q.recipe_version,
           **out}
    if cfg.train.extended_from:
        out["extended_from"] = list(cfg.train.extended_from)
    return out


def _named_for_plan(cfg: RunConfig) -> RunConfig:
    """A config file's run under ``quant.plan`` named for it: ``<group>/<recipe>-s<seed>``
    (the config files' names) becomes ``<group>/<run_label>-s<seed>``, so that a plan run
    never takes the directory, or the label, of a plain run of its recipe."""
    head, slash, last = cfg.name.rpartition("/")
    if cfg.quant.plan is None or last != f"{cfg.quant.recipe}-s{cfg.seed}":
        return cfg
    label = run_label(cfg.quant.recipe, plan_identity(autoquant.Plan.load(cfg.quant.plan)))
    return dataclasses.replace(cfg, name=f"{head}{slash}{label}-s{cfg.seed}")


def quant_rules(q: QuantConfig) -> list[tuple[str, str | lb.Recipe]]:
    """``lowbit.flax`` rules: the plan's sites first (``quant.plan``: each its planned recipe),
    then the high-precision modules, everything else under the recipe."""
    rules: list = []
    if q.plan is not None:
        rules += autoquant.Plan.load(q.plan).rules()
    if q.high_precision:
        rules.append((q.high_precision, "none"))
    rules.append((r".*", q.recipe))
    return rules


def config_diff(saved: dict, now: dict, prefix=(), free=frozenset()) -> list[str]:
    """The fields that differ between two ``RunConfig.to_json()`` dicts, as ``"a.b: x -> y"``,
    leaving out those a run may change when resumed (the name, the workdir, ``RESUMABLE``) and
    the keys in ``free`` (tuples, such as ``("train", "steps")``).
    A key missing on one side reads as None (a field added since the run was written), or as
    the value older runs had in effect for the fields ``ADDED`` lists."""
    out = []
    for k in sorted(set(saved) | set(now)):
        key = (*prefix, k)
        a, b = saved.get(k, ADDED.get(key)), now.get(k, ADDED.get(key))
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, key, free)
        elif a != b and key not in RESUMABLE | free and key not in (("name",), ("workdir",)):
            out.append(f"{'.'.join(key)}: {a!r} -> {b!r}")
    return out


EXPECTED_RUN = "expected a run directory written by experiments.train (config.json, checkpoints/)"


def check_run_dir(src: Path, what: str) -> None:
    """ConfigError naming ``what=src`` unless ``src`` is a directory with a config.json."""
    if not src.exists():
        raise ConfigError(f"{what}={str(src)!r} does not exist; {EXPECTED_RUN}")
    if not (src / "config.json").is_file():
        raise ConfigError(
            f"{what}={str(src)!r} is not a run directory (no config.json); {EXPECTED_RUN}"
        )


def read_run_config(src: Path, what: str) -> dict:
    """The dict of ``src/config.json`` (a ConfigError naming ``what=src`` when unreadable)."""
    try:
        saved = json.loads((src / "config.json").read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise ValueError("no model section")
        return saved
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{what}={str(src)!r}: cannot read the model section of its config.json "
            f"({type(e).__name__}: {e}); {EXPECTED_RUN}"
        ) from None


def split_list(s) -> list[str]:
    """The items of a comma-separated config string (``"mxfp4, nvfp4"`` -> two names)."""
    return [x.strip() for x in str(s).split(",") if x.strip()]


def fine_tune_config(
    base, *, recipe: str, name: str, steps: int, lr: float, init_from: str, plan: str | None = None
):
    """A copy of the ConfigDict ``base`` (``configs/gpt.py``'s, ``configs/digits.py``'s) for a
    short fine-tune from the run ``init_from`` under ``recipe`` (and ``plan``, a saved
    :class:`lowbit.autoquant.Plan`): ``steps`` steps at peak ``lr`` after a ``steps // 10``
    warmup, evaluated and checkpointed only at the end."""
    c = copy.deepcopy(base)
    c.quant.recipe = recipe
    if plan is not None:
        c.quant.plan = str(plan)
    c.name = name
    c.init_from = init_from
    if c.get("init_from_hf"):  # the float run started from it: its model section, its weights
        family = c.get("family") or DEFAULT_FAMILY
        dtype = c.model.get("dtype", "float32")
        model = to_plain(_hf_model(c.init_from_hf, family, "float32"))
        c.model = ml_collections.ConfigDict({**model, "dtype": dtype})
        c.init_from_hf = ""
    c.train.steps = steps
    c.train.lr = lr
    c.train.warmup_steps = max(0, steps // 10)
    c.train.eval_every = 0
    c.train.checkpoint_every = 0
    return c
