"""The layers of docs/design.md §2, checked on the source: who may import whom, and how big a module grows.

(anchor: SpecForge ``tests/test_runtime/test_package_architecture.py``)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "eagleflow"
# The foundation at the top of eagleflow/ (docs/design.md §2): what every room may use, nothing more.
FOUNDATION = {
    "__init__.py", "__main__.py", "config.py", "deploy.py", "errors.py", "files.py", "layout.py", "progress.py",
    "results.py", "reuse.py", "startup.py",
}
MAX_TOP_MODULES = 12
STAGES = {"engine", "data", "extract", "train", "metrics", "export", "evaluate", "demo", "sglang_rules", "drafters", "verifier", "run", "report"}
# A module past this many lines asks for a reason (below): past it, a file usually holds two things, and
# the fix is to split it along its seam, never to join lines to fit.
SIZE_BUDGET = 400
OVER_BUDGET: dict[str, str] = {
    "eagleflow/engine/reference/runner.py": "one engine's model, its forward passes and the capture, held together by the "
    "lock that orders them; /model_info's speculative_num_draft_tokens was once cut to fit the line limit",
}


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


def test_the_top_of_the_core_holds_only_the_foundation() -> None:
    top = {p.name for p in CORE.iterdir() if p.suffix == ".py"}
    packages = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == FOUNDATION
    assert len(top) <= MAX_TOP_MODULES
    assert packages == STAGES


def test_a_module_over_its_size_budget_has_a_reason() -> None:
    """Past :data:`SIZE_BUDGET` lines a module is named in :data:`OVER_BUDGET` with why it stays whole; a named
    one back under the budget leaves the list."""
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in ("eagleflow", "operators", "plugins", "sglang_patch", "dags")
        for path in sorted((REPO / folder).rglob("*.py"))
    }
    assert [f"{p}: {n} lines" for p, n in sizes.items() if n > SIZE_BUDGET and p not in OVER_BUDGET] == []
    assert [p for p in OVER_BUDGET if sizes.get(p, 0) <= SIZE_BUDGET] == []


def stage_of(path: Path) -> str | None:
    """The stage package a core module belongs to (None for the cross-cutting modules at the top)."""
    parts = path.relative_to(CORE).parts
    return parts[0] if len(parts) > 1 else None


def is_package(module: str) -> bool:
    return (REPO / Path(*module.split(".")) / "__init__.py").exists()


def cross_stage_imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import of another stage in ``path`` (``names`` empty for ``import x``)."""
    own = stage_of(path)
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return [
        (module, names) for module, names in found
        if module.startswith("eagleflow.") and module.split(".")[1] in STAGES and module.split(".")[1] != own
    ]


def test_stages_import_one_another_only_through_a_packages_public_names() -> None:
    """A stage reaches another through ``from eagleflow.<stage> import name`` (or a sub-package's), where
    ``name`` is in that package's ``__all__``: what a stage offers the others is its ``__init__``'s list."""
    import importlib

    bad = []
    for path in sorted(CORE.rglob("*.py")):
        if stage_of(path) is None:
            continue
        for module, names in cross_stage_imports(path):
            where = f"{path.relative_to(REPO)}: {module}"
            if not names or not is_package(module):
                bad.append(f"{where} (import through the package, not its module)")
                continue
            public = set(importlib.import_module(module).__all__)
            bad += [f"{where} import {name} (not in its __all__)" for name in names if name not in public]
    assert bad == []


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_public_name_of_a_stage_resolves(stage: str) -> None:
    """Each name a stage's ``__init__`` lists imports (they load lazily, so a typo would hide until used)."""
    import importlib

    package = importlib.import_module(f"eagleflow.{stage}")
    assert [name for name in package.__all__ if getattr(package, name, None) is None] == []


def test_importing_every_stage_package_imports_no_torch() -> None:
    """A stage's public names load lazily: the Airflow processes that only read a package's light names
    (the API server reading shard manifests, the triggerer probing an engine) never pay for torch."""
    import subprocess
    import sys

    code = "import sys\n" + "".join(f"import eagleflow.{s}\n" for s in sorted(STAGES)) + "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
