"""The README's Python blocks run as written (issue 29, point 8), so an example that goes stale
fails the suite.

Every ```` ```python ```` block of README.md runs, in the README's order, in one namespace:
the README builds on itself (the Quickstart's imports, the tiny GPT that the Flax,
post-training and bit-budget sections share), as a reader pasting it into one session would.
The fence's info string says what else to do with a block, and the README says so too:
``python slow`` blocks (GPTQ, smoothing: tens of seconds on 2 CPU cores) run only in the slow
test (``make test-slow``), so no block that ``make test`` runs may depend on one; ``python
no-run: <reason>`` blocks never run and must give the reason. The blocks run in a temporary
directory (they write checkpoints and plans), and a failure names the README line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
KINDS = ("run", "slow", "no-run")


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # the README line of the block's first code line
    kind: str  # one of KINDS
    reason: str  # no-run: why
    code: str
    section: str  # the "## " heading above it


def readme_blocks(text: str | None = None) -> list[Block]:
    """The ```` ```python ```` blocks of the README, in order; a ValueError names the line of
    a fence whose info string is not one of ``""``, ``"slow"``, ``"no-run: <reason>"``."""
    text = README.read_text() if text is None else text
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        info = m["info"].strip()
        kind, _, reason = info.partition(":")
        kind = kind.strip() or "run"
        if kind not in KINDS or (kind == "no-run") != bool(reason.strip()):
            raise ValueError(
                f"README.md:{line - 1}: fence info {info!r}: expected ```python, ```python "
                "slow or ```python no-run: <reason>"
            )
        heads = re.findall(r"^## (.+)$", text[: m.start()], re.M)
        out.append(Block(line, kind, reason.strip(), m["code"], heads[-1] if heads else ""))
    return out


def run_blocks(blocks: list[Block]) -> None:
    """Execute ``blocks`` in order in one namespace; tracebacks carry README line numbers."""
    ns: dict = {"__name__": "__readme__"}
    for b in blocks:
        code = compile("\n" * (b.line - 1) + b.code, str(README), "exec")
        try:
            exec(code, ns)
        except Exception as e:
            raise AssertionError(
                f"README.md:{b.line} ({b.section}): the block stops with "
                f"{type(e).__name__}: {e}"
            ) from e


def test_the_readme_blocks_run_as_written(tmp_path, monkeypatch):
    blocks = [b for b in readme_blocks() if b.kind == "run"]
    monkeypatch.chdir(tmp_path)
    run_blocks(blocks)


@pytest.mark.slow
def test_the_readme_blocks_run_as_written_slow_ones_included(tmp_path, monkeypatch):
    blocks = [b for b in readme_blocks() if b.kind in ("run", "slow")]
    monkeypatch.chdir(tmp_path)
    run_blocks(blocks)


def test_the_sections_on_models_start_from_a_model_that_runs():
    """Flax, PTQ and autoquant examples need a model, batches and a loss: a block that runs
    defines them before the first of those sections uses them, and every section runs some."""
    blocks = readme_blocks()
    kinds = {}
    for b in blocks:
        kinds.setdefault(b.section, []).append(b.kind)
    for section in ("Quickstart", "Training with quantized GEMMs", "Flax",
                    "Post-training quantization", "Per-layer precision under a bit budget"):
        assert "run" in kinds.get(section, []), f"README section {section!r} runs no block"
    first_use = next(i for i, b in enumerate(blocks) if re.search(r"\bmodel\b", b.code))
    defining = [b for b in blocks[: first_use + 1] if b.kind == "run"
                and re.search(r"^model = ", b.code, re.M)]
    assert defining and all(re.search(rf"^{name}\b", defining[0].code, re.M)
                            for name in ("model", "batches", "def next_token_loss"))


def test_fences_are_python_or_say_why_not():
    text = README.read_text()
    langs = re.findall(r"^```(\S+)", text, re.M)
    assert not {lang for lang in langs if lang in ("py", "python3", "pycon", "ipython")}
    assert sum(lang == "python" for lang in langs) == len(readme_blocks(text))
    with pytest.raises(ValueError, match=r"README.md:2: fence info 'no-run'"):
        readme_blocks("x\n```python no-run\npass\n```\n")  # no reason
    with pytest.raises(ValueError, match="fence info 'gpu'"):
        readme_blocks("```python gpu\npass\n```\n")
    (b,) = readme_blocks("## S\n```python no-run: needs a GPU\npass\n```\n")
    assert (b.kind, b.reason, b.line, b.section) == ("no-run", "needs a GPU", 3, "S")


def test_the_readme_is_self_contained():
    """No path out of the repository (the README once pointed at ../shared/DESIGN.md), and
    every relative link names a file of the repository."""
    text = README.read_text()
    assert "../" not in text
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (README.parent / target).exists(), f"README links to missing {target}"


def test_the_recipes_packed_residuals_do_not_combine_with_are_the_ones_named():
    import lowbit as lb

    refused = set()
    for name in lb.recipes.names():
        try:
            lb.recipes.get(name).replace(residuals="quantized")
        except ValueError:
            refused.add(name)
    text = " ".join(README.read_text().split())
    said = re.search(r"residuals=\"quantized\"\)` saves.*?does not combine with (.*?)\)", text)
    assert said, "the README no longer says which recipes residuals='quantized' refuses"
    named = set(re.findall(r"`(\w+)`", said[1])) & set(lb.recipes.names())
    assert named == refused
