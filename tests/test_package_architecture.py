"""The layers of DESIGN.md §2, checked on the source: who may import whom, and how big a module grows.

(anchor: SpecForge ``tests/test_runtime/test_package_architecture.py``)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "eagleflow"
# The top of eagleflow/ holds only what every stage uses; each stage is a package.
CROSS_CUTTING = {
    "__init__.py", "__main__.py", "config.py", "deploy.py", "errors.py", "files.py", "layout.py",
    "pipeline.py", "progress.py", "results.py", "run_report.py", "report_shapes.py", "step_params.py",
}
STAGES = {"engine", "data", "extract", "train", "metrics", "export", "evaluate", "demo"}
MAX_MODULE_LINES = 400


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports included)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def offenders(folder: Path, forbidden: str) -> list[str]:
    return [
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted(folder.rglob("*.py"))
        for name in imported_modules(path)
        if name == forbidden or name.startswith(forbidden + ".")
    ]


@pytest.mark.parametrize("folder", ["eagleflow", "sglang_patch"])
def test_no_airflow_import_under_the_core_or_the_hook(folder: str) -> None:
    """eagleflow/ and sglang_patch/ run without Airflow, in every stage package."""
    assert offenders(REPO / folder, "airflow") == []


def test_the_hook_package_imports_nothing_of_eagleflow() -> None:
    """sglang_patch/ installs into the SGLang image alone (docker/sglang.Dockerfile)."""
    assert offenders(REPO / "sglang_patch", "eagleflow") == []


def test_the_products_stages_never_import_the_demo() -> None:
    product = [p for p in sorted(CORE.rglob("*.py")) if "demo" not in p.relative_to(CORE).parts]
    bad = [f"{p.relative_to(REPO)}: {n}" for p in product for n in imported_modules(p) if n.startswith("eagleflow.demo")]
    assert bad == []


def test_the_top_of_the_core_holds_only_the_cross_cutting_modules() -> None:
    top = {p.name for p in CORE.iterdir() if p.suffix == ".py"}
    packages = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == CROSS_CUTTING
    assert packages == STAGES


def test_no_module_is_over_the_size_limit() -> None:
    big = [
        f"{path.relative_to(REPO)}: {n} lines"
        for folder in ("eagleflow", "operators", "plugins", "sglang_patch", "dags")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert big == []
