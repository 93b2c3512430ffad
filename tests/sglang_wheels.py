"""Reading SGLang's real source from its wheels, without installing it (it cannot run on CPU).

The wheels are fetched with ``pip download --no-deps`` into ``.cache/sglang-wheels`` (kept between
runs) and read straight from the zip. Shared by the hook's source tests and the export's.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagleflow.demo.tiny_model import build_lock

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".cache" / "sglang-wheels"
NETWORK_ERRORS = (
    "NewConnectionError", "ConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
    "Network is unreachable", "Name or service not known", "ConnectTimeout", "ReadTimeout", "ProxyError",
)


def pinned_version() -> str:
    """The ``sglang==X`` pin of pyproject.toml's ``sglang`` extra."""
    match = re.search(r'^sglang = \["sglang==([^"]+)"\]', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, 'pyproject.toml lacks the line sglang = ["sglang==X"]'
    return match.group(1)


class Wheel:
    """Source files of one SGLang wheel, read from the zip without installing it."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version
        self._zip = zipfile.ZipFile(path)
        self.names = set(self._zip.namelist())

    def text(self, name: str) -> str:
        assert name in self.names, f"{name} is missing from {self.path.name}"
        return self._zip.read(name).decode("utf-8")

    @functools.cache
    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name), filename=name)

    def under(self, folder: str) -> list[str]:
        return sorted(n for n in self.names if n.startswith(folder) and n.endswith(".py"))

    def where(self, name: str, node: ast.AST) -> str:
        return f"{name}:{node.lineno} in sglang {self.version}"


_wheels: dict[str, Wheel] = {}


def get_wheel(version: str) -> Wheel:
    """The wheel of ``version``, downloaded once into .cache/sglang-wheels; skip only if PyPI is unreachable."""
    if version in _wheels:
        return _wheels[version]
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    with build_lock(WHEEL_DIR / f"sglang-{version}"):  # parallel workers: one downloads, the others wait
        _wheels[version] = _download(version)
    return _wheels[version]


def _download(version: str) -> Wheel:
    found = sorted(WHEEL_DIR.glob(f"sglang-{version}-*.whl"))
    if not found:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
            "--timeout", "30", "--retries", "1", "-q", "-d", str(WHEEL_DIR), f"sglang=={version}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            if any(marker in done.stderr for marker in NETWORK_ERRORS):
                pytest.skip(f"PyPI unreachable, cannot fetch sglang=={version}: {done.stderr.strip().splitlines()[-1]}")
            pytest.fail(f"pip download sglang=={version} failed:\n{done.stderr}")
        found = sorted(WHEEL_DIR.glob(f"sglang-{version}-*.whl"))
        assert found, f"pip download sglang=={version} left no wheel in {WHEEL_DIR}"
    try:
        return Wheel(found[0], version)
    except zipfile.BadZipFile:
        found[0].unlink()  # an interrupted download; the next run fetches it again
        pytest.fail(f"{found[0].name} was not a complete wheel; deleted it, run again")


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def find_function(scope: ast.AST, name: str) -> ast.FunctionDef:
    for node in scope.body:  # type: ignore[attr-defined]
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def cli_flags(wheel: Wheel) -> set[str]:
    """Every ``--flag`` sglang.launch_server accepts in this version.

    Two declaration styles: ``parser.add_argument("--flag", ...)`` (all versions; only style up
    to 0.5.13) and ``field: A[T, "help" | Arg(...)]`` dataclass fields whose flag is derived
    from the name (``arg_groups/arg_utils.py``: ``--`` + name with ``-``, or ``cli_name``,
    plus ``aliases``; ``Arg(no_cli=True)`` has none), in ``server_args.py`` (0.5.14-0.5.19)
    and ``arg_groups/fields/*.py`` (0.5.20).
    """
    flags: set[str] = set()
    for name in ["sglang/srt/server_args.py", *wheel.under("sglang/srt/arg_groups/")]:
        tree = wheel.tree(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                ann = stmt.annotation
                if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in ("A", "Annotated")):
                    continue
                meta = ann.slice.elts[1:] if isinstance(ann.slice, ast.Tuple) else []
                kw = {k.arg: k.value for m in meta if isinstance(m, ast.Call) for k in m.keywords}
                if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value:
                    continue
                cli_name = kw.get("cli_name")
                flags.add(cli_name.value if isinstance(cli_name, ast.Constant) else "--" + stmt.target.id.replace("_", "-"))
                if isinstance(kw.get("aliases"), ast.List):
                    flags.update(e.value for e in kw["aliases"].elts if isinstance(e, ast.Constant))
    return flags
