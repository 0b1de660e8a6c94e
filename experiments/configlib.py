"""Config plumbing: parse ``get_config`` arguments, load config files, build dataclasses.

Config files are Python (``configs/*.py`` with ``get_config(arg)``, ml_collections style). The
argument after the colon of ``--config configs/gpt.py:size=tiny,recipe=mxfp4`` is a comma-
separated ``key=value`` list; :func:`parse_arg` types each value after its default.

Library code never reads a ``ConfigDict``: :func:`to_dataclass` turns one section into the
frozen dataclass the code takes, refusing unknown keys with the section's name.

>>> a = parse_arg("size=xs,seed=3", size="tiny", seed=0, moe=False)
>>> a.size, a.seed, a.moe
('xs', 3, False)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from pathlib import Path
from typing import Any, TypeVar

import ml_collections

__all__ = ["ConfigError", "parse_arg", "load_config", "to_dataclass", "to_plain", "flatten",
           "parse_flags_or_exit", "one_line"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used: names the key and what was expected."""


def _typed(key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config argument {key}={value!r}: expected a boolean (true/false)")
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(value)
            except ValueError:
                raise ConfigError(
                    f"config argument {key}={value!r}: expected {kind.__name__}"
                ) from None
    return value


def parse_arg(arg: str | None, **defaults: Any) -> types.SimpleNamespace:
    """Parse ``"k=v,k2=v2"`` against ``defaults`` (unknown keys are errors)."""
    out = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        if "=" not in item:
            raise ConfigError(f"config argument {item!r}: expected key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in defaults:
            raise ConfigError(f"config argument {k!r}: unknown; expected one of {sorted(defaults)}")
        out[k] = _typed(k, v, defaults[k])
    return types.SimpleNamespace(**out)


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``"configs/gpt.py:size=tiny"`` -> the ConfigDict its ``get_config`` returns."""
    path, _, arg = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config(arg)")
    return module.get_config(arg or None)


def flatten(d: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """A nested dict (a config's ``to_dict()``, a ``config.json``) as ``{key path: leaf}``.

    >>> flatten({"train": {"steps": 5, "opt": {"lr": 0.1}}, "seed": 0})
    {('train', 'steps'): 5, ('train', 'opt', 'lr'): 0.1, ('seed',): 0}
    """
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def to_plain(x: Any) -> Any:
    """A ConfigDict (or dataclass) as plain JSON-able dicts and lists."""
    if isinstance(x, ml_collections.ConfigDict):
        x = x.to_dict()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_plain(v) for v in x]
    return x


def to_dataclass(cls: type[T], section: Any, name: str) -> T:
    """Build ``cls`` from a config section; unknown keys raise :class:`ConfigError`."""
    values = to_plain(section) if section is not None else {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"config.{name}: unknown key(s) {unknown}; expected a subset of {sorted(fields)}"
        )
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(tuple(e) if isinstance(e, list) else e for e in v)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.{name}: {e}") from e


def one_line(e: BaseException) -> str:
    """An error as one line: the innermost cause's message, with ml_collections' quoted
    "unknown field" form (``'\\'stesp\\'\\nDid you mean "steps" ...'``) made readable."""
    chain = [e]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    hinted = [c for c in chain if isinstance(c, (AttributeError, KeyError))
              and "Did you mean" in str(c)]
    e = hinted[-1] if hinted else chain[-1]
    msg = str(e)
    if isinstance(e, (AttributeError, KeyError)):
        msg = msg.strip("'\"").replace("\\'", "'").replace("\\n", "\n")
        name, _, hint = msg.partition("\n")
        msg = f"unknown config field {name.strip()}" + (f": {hint.strip()}" if hint else "")
    return " ".join(msg.split())


def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """absl's flag parsing for ``app.run(main, flags_parser=...)`` with the promise every
    CLI here makes: a bad flag or config (an unknown size, config argument or
    ``--config.<field>`` override) exits with status 1 and one line, ``error: ...``, not a
    traceback."""
    import sys

    from absl import flags

    try:
        return flags.FLAGS(argv)
    except Exception as e:  # flags.Error, and what a config file or override raises
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(1)

