"""The CPU environment the bootstrap builds: everything imports, no CUDA-only torchvision/torchaudio."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys


def test_the_stack_imports_together() -> None:
    probe = "import speculators, speculators.train.trainer, transformers, airflow.sdk, torch; print(torch.__version__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("2.13.0")


def test_no_torchvision_or_torchaudio() -> None:
    """PyPI's are CUDA builds that break `import transformers` on a CPU machine (docs/design.md §5)."""
    for name in ("torchvision", "torchaudio"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed in the CPU environment")
    assert importlib.metadata.version("speculators") == "0.9.0"
    assert importlib.metadata.version("hs-connectors") == "0.9.0"
