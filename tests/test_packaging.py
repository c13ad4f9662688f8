"""What the install pulls in, and CI's script: numpy is a dependency, Triton an extra of its own,
CI in a fresh folder per run with the README's test command verbatim; the README a front door to the
documentation site, whose nav names every page and which CI builds strictly."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CI = (ROOT / ".ci" / "run").read_text()


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0] for r in requirements}


def test_numpy_is_a_dependency_so_torch_does_not_warn():
    assert "numpy" in names(PROJECT["dependencies"])


def test_triton_is_in_the_kernels_extra_only_and_ci_installs_it():
    extras = PROJECT["optional-dependencies"]
    assert "triton" in names(extras["kernels"]) and "triton" not in names(extras["test"])
    assert 'pip install torch==2.13.0 -e ".[kernels]"' in CI


def test_ci_uses_a_fresh_folder_and_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"Run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    assert command.startswith("pip install torch==2.13.0 ") and command in CI.splitlines()
    assert "mktemp -d" in CI and 'rm -rf "$venv"\n' not in CI.split("trap")[0]


def test_the_readme_is_a_front_door_and_ci_builds_every_docs_page_strictly():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    head = "\n".join(readme[:40])
    assert "pip install torch==2.13.0 -e . && zeropp train" in head
    assert re.search(
        r"Run the tests:\n\n```bash\npip install torch==2\.13\.0 -e \"\.\[test\]\" && python -m pytest ", head
    )
    # the nav's pages: every `name.md` in mkdocs.yml (read as text: PyYAML is only in the docs extra)
    nav = set(re.findall(r"([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    docs = ROOT / "docs"
    pages = {
        p.relative_to(docs).as_posix()
        for p in docs.rglob("*.md")
        if p.relative_to(docs).parts[0] not in ("results", "img")
    }
    assert pages <= nav, sorted(pages - nav)
    assert "docs_dir: docs" in (ROOT / "mkdocs.yml").read_text()
    assert any(
        line.split("#")[0].strip().endswith('mkdocs build --strict --site-dir "$venv/site"') for line in CI.splitlines()
    )
