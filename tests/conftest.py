"""Shared test set-up: caches inside the repo, and the tiny verifier built once per session."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from eagleflow.startup import pause_collector, resume_collector

# Collection imports torch, datasets and Airflow into every worker: without the cyclic collector
# walking them as they load, then frozen out of the collections of the tests that follow.
_COLLECTOR_PAUSED = pause_collector()

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"

# Nothing leaks into the home folder, and nothing reaches for a model hub.
for _name, _value in {
    "HF_HOME": CACHE / "hf",
    "HF_DATASETS_CACHE": CACHE / "hf" / "datasets",
    "MPLCONFIGDIR": CACHE / "matplotlib",
    "PIP_CACHE_DIR": CACHE / "pip",
}.items():
    os.environ.setdefault(_name, str(_value))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def load_script(script: str) -> ModuleType:
    """``scripts/<script>.py`` as a module (scripts/ is not a package), loaded once."""
    name = f"eagleflow_scripts_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def scripts() -> Callable[[str], ModuleType]:
    """``scripts("airflow_env")``: a module of ``scripts/``, e.g. the local Airflow the tests run."""
    return load_script


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The trained tiny DeepSeek-V3 verifier: the demo's own (built once, cached under .cache/demo)."""
    from eagleflow.demo import demo_paths
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(out=Path(demo_paths(CACHE / "demo")["model_path"])))


@pytest.fixture(scope="session")
def random_tiny_model() -> Path:
    """An untrained tiny verifier with the same tokenizer recipe: fast, for plumbing tests."""
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(out=CACHE / "test-models" / "tiny-random", train_steps=0, corpus_rows=400))


# Airflow reads its configuration when first imported: point it at a throw-away SQLite home
# inside the repo's cache, our dags/ and plugins/, before any test imports it.
# One home per xdist worker: each migrates its own SQLite file, which two writers would corrupt.
AIRFLOW_TEST_HOME = CACHE / f"airflow-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
os.environ["AIRFLOW_HOME"] = str(AIRFLOW_TEST_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread in this process for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``).

    On a shared 2-core machine an engine subprocess and this process's busy-waiting OpenMP pools
    slow each other down many times over (40 ms forwards took seconds).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """An initialized (migrated) Airflow metadata DB for in-process ``dag.test()`` runs."""
    from metadata_db import migrated_sqlite_db

    home = Path(os.environ["AIRFLOW_HOME"])
    migrated_sqlite_db(home)
    return home


@pytest.fixture(scope="session")
def eagleflow_dag(airflow_db: Path):
    """The eagleflow DAG as the DAG processor sees it (DagBag of the repo's dags/)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag("eagleflow")


class HealthServer:
    """A real HTTP server on 127.0.0.1 whose ``/health_generate`` answers ``status`` after ``delay`` s."""

    def __init__(self) -> None:
        self.status = 503
        self.delay = 0.0
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.requests.append(self.path)
                time.sleep(outer.delay)
                self.send_response(outer.status if self.path == "/health_generate" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def health() -> Iterator[HealthServer]:
    server = HealthServer()
    yield server
    server.close()


@pytest.fixture()
def small_tmpfs(tmp_path: Path) -> Iterator[object]:
    """``mount(size) -> folder``: a real tmpfs of ``size`` (e.g. ``"2m"``) under ``tmp_path``, unmounted
    afterwards. Needs root; where mounting is refused the test is skipped, saying why."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{len(mounted)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture()
def params(tmp_path: Path, random_tiny_model: Path) -> dict[str, Any]:
    """A run's Params: the reference engine on the tiny model, any free port, one torch thread."""
    (tmp_path / "unused.jsonl").touch()  # the first task checks it is there; these tests read it no further
    return {
        "engine": "reference",
        "model_path": str(random_tiny_model),
        "dataset_input": str(tmp_path / "unused.jsonl"),
        "output_root": str(tmp_path / "out"),
        "server_port": 0,
        # One thread: the engine shares 2 cores with this test process.
        "server_extra_args": ["--threads", "1"],
    }


@pytest.fixture()
def process_groups() -> Iterator[list[int]]:
    """Process groups (= engine pids, session leaders) a test started; SIGKILLed and reaped afterwards."""
    import contextlib
    import signal

    started: list[int] = []
    yield started
    for pgid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pgid, 0)


# --------------------------------------------------------------------------- parallel runs
# `make test` runs the suite on several xdist workers. A module's tests stay
# on one worker (its module fixtures, an Airflow stack, engines, are started once), except the
# modules below whose tests are long and independent; and the longest work is handed out first,
# so no worker is left with a long test at the end (durations measured on 2 cores).
SLOW_FIRST = (  # each module's share of a whole run on 2 cores, longest first (seconds of a loaded run, 2026-12-07)
    "tests/dags/test_celery.py",  # 810 s (three runs then; two since)
    "tests/dags/test_scheduler.py",  # 825 s
    # the browser's Airflow: a run triggered from the form, trained and measured (about 245 s alone)
    "tests/plugins/test_ui_in_airflow.py",
    # 826 s, after the Airflow modules: its first test builds the trained tiny verifier, and a worker
    # handed a second one of its tests at the start would only wait for that build (131 s idle, measured)
    "tests/eagleflow/train/test_online.py",
    "tests/dags/test_dag.py",  # 254 s
    "tests/eagleflow/train/test_online_mooncake.py",  # 218 s
    "tests/eagleflow/evaluate/test_evaluate_faults.py",  # 172 s
    "tests/eagleflow/extract/test_extract_faults.py",  # 163 s
    "tests/eagleflow/train/test_train_step.py",  # 140 s
    "tests/eagleflow/train/test_nodes.py",  # 129 s
    "tests/eagleflow/drafters/dflash/test_dflash_reference.py",  # 117 s
    "tests/eagleflow/train/test_speculators_support.py",  # 99 s
    "tests/eagleflow/drafters/dspark/test_dspark_reference.py",  # 82 s
    "tests/eagleflow/data/test_regenerate.py",  # 79 s
    "tests/eagleflow/extract/test_verify_capture.py",  # 74 s
    "tests/eagleflow/export/test_export.py",  # 69 s
    "tests/eagleflow/evaluate/test_evaluate.py",  # 55 s
    "tests/eagleflow/engine/test_reference_engine.py",  # 52 s
    "tests/sglang_patch/test_sglang_source.py",  # 36 s
    "tests/eagleflow/extract/test_shard.py",  # 34 s
    "tests/operators/test_server.py",  # 33 s
    "tests/eagleflow/export/test_export_faults.py",  # 29 s
    "tests/eagleflow/export/test_export_self_checks.py",  # 27 s
    "tests/eagleflow/evaluate/test_evaluate_inputs.py",  # 25 s
    "tests/eagleflow/train/test_train_disk_full.py",  # 25 s
    "tests/eagleflow/drafters/eagle3/test_speculative.py",  # 23 s
    "tests/eagleflow/extract/test_shared_dump_folder.py",  # 22 s
    "tests/eagleflow/demo/test_tiny_model.py",  # 22 s
    "tests/docker/test_compose.py",  # 21 s
    "tests/benchmarks/test_gpu_check.py",  # 21 s
    "tests/eagleflow/export/test_export_parity.py",  # 20 s
    "tests/eagleflow/drafters/eagle3/test_sglang_drafter_source.py",  # 19 s
)
SPLIT_MODULES = {
    "tests/eagleflow/train/test_online.py",
    "tests/dags/test_dag.py",
    "tests/eagleflow/train/test_speculators_support.py",
    "tests/eagleflow/train/test_train_step.py",
}


@pytest.hookimpl(optionalhook=True)  # also with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """A module's tests as one work unit, but each test of :data:`SPLIT_MODULES` on its own.

    (Our own scope rule: xdist's ``loadgroup`` marks groups by rewriting ``item._nodeid``, which
    pytest 9.2's nodes no longer read.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return nodeid if path in SPLIT_MODULES else path

    return ModuleScheduling(config, log)


def _collection_done() -> None:
    global _COLLECTOR_PAUSED
    resume_collector(_COLLECTOR_PAUSED)
    _COLLECTOR_PAUSED = False


def pytest_collection_finish(session: pytest.Session) -> None:
    _collection_done()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    _collection_done()  # xdist's controller collects nothing: its collector restarts here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept within
