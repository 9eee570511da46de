"""The package's conventions: it ships ``py.typed``, and the API reference (docs/api, built by
``mkdocs build --strict`` in scripts/test.sh) documents every public name."""

import re
from pathlib import Path

import gradaccum
import gradaccum.core
import gradaccum.torch

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(gradaccum.__file__).parent


def members(page):
    """The names a ``::: module`` directive of ``docs/api/PAGE`` lists under ``members:``."""
    text = (ROOT / "docs" / "api" / page).read_text()
    return set(re.findall(r"^\s+- (\w+)$", text, re.MULTILINE))


def test_the_package_ships_py_typed():
    assert (SRC / "py.typed").is_file()
    # hatch puts the whole folder in the wheel, py.typed included (nothing excludes files).
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    assert '[tool.hatch.build.targets.wheel]\npackages = ["src/gradaccum"]\n' in pyproject
    wheel = pyproject.split("[tool.hatch.build.targets.wheel]")[1].split("\n[")[0]
    assert "exclude" not in wheel and "only-include" not in wheel  # (the sdist leaves out data/)


def test_the_gradaccum_page_renders_the_whole_of_all():
    # `::: gradaccum` with no members list renders __all__ (filters: public).
    text = (ROOT / "docs" / "api" / "gradaccum.md").read_text()
    assert re.search(r"^::: gradaccum$", text, re.MULTILINE) and "members:" not in text


def test_every_public_name_of_the_torch_adapter_and_the_core_has_a_page():
    top = set(gradaccum.__all__)
    assert set(gradaccum.torch.__all__) - top == members("torch.md")
    assert set(gradaccum.core.__all__) - top == members("core.md")


def test_every_api_page_is_in_the_mkdocs_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if p not in nav} == set()
