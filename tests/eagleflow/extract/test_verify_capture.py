"""The capture gate against a live reference engine: it passes on the real capture, and names the cause
when the engine is made to capture wrongly (``capture_fault`` in ``EAGLEFLOW_TEST_FAULTS``, TEST ONLY), one engine per fault.

The gate runs as the DAG runs it, ``python -m eagleflow verify-capture`` in a child process; its
exit code, its log lines and ``report.json`` are what the tests read. The engine serves the trained
tiny verifier (bf16), whose logits are confident enough for a real top-1 comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eagleflow.config import model_to_argv
from eagleflow.verifier.config import config_int
from eagleflow.engine.process import Readiness, ServerInfo, check_ready, free_port, pid_alive, start_server, stop_server
from eagleflow.engine.reference_config import ReferenceEngineConfig
from eagleflow.engine.reference.faults import faults_env
from eagleflow.extract.capture_checks import (
    OFF_BY_ONE,
    PARTIAL_SUM,
    PARTIAL_SUM_EMBEDDING,
    POST_NORM,
    RADIX_CACHE,
)
from eagleflow.layout import RunLayout
from eagleflow.results import find_result
from eagleflow.report.run_page import capture_check_summaries

REPO = Path(__file__).resolve().parents[3]
ROWS = 6


@pytest.fixture(scope="module")
def run_layout(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """A run folder whose dataset holds the tiny verifier's first synthetic conversations."""
    from eagleflow.data.prepare import PrepareConfig, prepare_dataset
    from eagleflow.demo.synthetic_data import DatasetConfig, make_dataset

    root = tmp_path_factory.mktemp("gate")
    make_dataset(DatasetConfig(verifier=tiny_model, out=root / "conversations.jsonl", rows=ROWS))
    layout = RunLayout.of(root / "runs", "gate")
    prepare_dataset(PrepareConfig(input=root / "conversations.jsonl", verifier=tiny_model, out=layout.dataset, max_len=256))
    return layout


@dataclass
class Gate:
    """One finished ``verify-capture`` run."""

    returncode: int
    output: str
    report: dict[str, Any]
    result: dict[str, Any] | None

    def findings(self, check: str) -> list[dict[str, Any]]:
        return [f for f in self.report["findings"] if f["check"] == check]


@pytest.fixture()
def gate_against(tiny_model: Path, run_layout: RunLayout, tmp_path: Path) -> Iterator[Callable[..., Gate]]:
    """Start an engine with ``aux`` storing ``dtype`` (``capture_fault``: the test-only fault it commits), run the gate
    against it, stop the engine."""
    engines: list[ServerInfo] = []

    def run(aux: list[int], capture_fault: str | None = None, dtype: str = "bf16") -> Gate:
        port, dumps = free_port(), tmp_path / "dumps"
        engine = ReferenceEngineConfig(
            model=tiny_model, dump_dir=dumps, aux_layers=aux, port=port, threads=1, hidden_states_dtype=dtype
        )
        argv = [sys.executable, "-m", "eagleflow", "serve-reference", *model_to_argv(engine)]
        faults = faults_env(capture_fault=capture_fault) if capture_fault else {}
        info = start_server(argv, faults, tmp_path / "server.log", tmp_path / "server.json", f"http://127.0.0.1:{port}", dumps)
        engines.append(info)
        deadline = time.monotonic() + 120
        while check_ready(info).state is not Readiness.READY:
            assert time.monotonic() < deadline and pid_alive(info.pid), (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.3)
        out = tmp_path / "verify"
        done = subprocess.run(
            [sys.executable, "-m", "eagleflow", "verify-capture", "--dataset", str(run_layout.dataset), "--server", info.url,
             "--dump-dir", str(dumps), "--verifier", str(tiny_model), "--aux-layer-ids", ",".join(map(str, aux)),
             "--hidden-states-dtype", dtype, "--out", str(out)],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )
        output = done.stdout + done.stderr
        assert (out / "report.json").is_file(), output
        # The gate leaves nothing in the engine's hand-off folder for the extractor to trip over.
        assert sorted(p.name for p in dumps.iterdir() if not p.name.startswith(".")) == [], output
        return Gate(done.returncode, output, json.loads((out / "report.json").read_text()), find_result(output.splitlines()))

    yield run
    for info in engines:
        stop_server(info.pid, grace=10)


def test_the_gate_passes_on_the_real_capture(gate_against: Callable[..., Gate], tiny_model: Path) -> None:
    gate = gate_against([0, 4, 6])
    assert gate.returncode == 0, gate.output
    report = gate.report
    assert report["passed"] and report["findings"] == [] and report["rows_checked"] == 4
    final = report["final_slot"]
    # Every compared position of every row: the final slot reproduces the engine's top-1 and log-probabilities.
    assert final["positions"] == report["tokens"] and final["top1_agreement"] == 1.0
    assert final["worst"]["error"] <= final["worst"]["tolerance"] and final["worst_ratio"] <= 1.0
    # A pre-norm final state is far from a norm's output (RMS 1 with the weight divided out): every
    # position on one side of 1, ten times the gate's own margin away.
    low, high = report["slots"][-1]["normed_rms_range"]
    assert high < 0.9 or low > 1.1, (low, high)
    assert report["embedding"]["equal"] and report["embedding"]["max_abs_diff"] == 0.0
    assert report["extraction_request"]["cached_tokens"] == 0
    assert report["extraction_request"]["max_relative_difference"] == 0.0  # the extractor's request captures the same
    assert [s["layer_id"] for s in report["slots"]] == [0, 4, 6, config_int(tiny_model, "num_hidden_layers")]
    assert all(s["nearest_distance"] > 0.01 and s["mean_token_norm"] > 0 for s in report["slots"])
    assert report["engine"]["tp_size"] == 1 and report["engine"]["disable_radix_cache"] is True
    # The figures reach the task log, the XCom and the run page's reader.
    assert "capture check passed" in gate.output and "slot 3 (layer id 8): mean token norm" in gate.output
    assert gate.result is not None and gate.result["passed"] and gate.result["top1_agreement"] == 1.0


def test_the_gate_passes_on_an_fp8_capture(gate_against: Callable[..., Gate]) -> None:
    """fp8 storage (what the GPU guide recommends): the dumps are checked dequantised, as training reads
    them, within fp8's rounding, and id 0 is still bit-exact once the embedding is quantised alike."""
    gate = gate_against([0, 4, 6], dtype="fp8")
    assert gate.returncode == 0, gate.output
    report = gate.report
    assert report["passed"] and report["hidden_states_dtype"] == "fp8" and report["tolerance"]["rtol"] == 2.0**-4
    assert report["final_slot"]["top1_agreement"] == 1.0 and report["final_slot"]["worst_ratio"] <= 1.0
    assert report["embedding"]["equal"] and report["extraction_request"]["max_relative_difference"] == 0.0


def test_a_post_norm_final_state_is_caught(gate_against: Callable[..., Gate]) -> None:
    gate = gate_against([2, 4, 5], capture_fault="post-norm-final")
    assert gate.returncode == 1 and not gate.report["passed"], gate.output
    (finding,) = gate.findings("final slot is pre-norm")
    assert (finding["slot"], finding["layer_id"], finding["basis"]) == (3, 8, "tested")
    assert finding["cause"].startswith(POST_NORM)
    low, high = gate.report["slots"][-1]["normed_rms_range"]
    assert 0.99 <= low <= high <= 1.01
    assert "error: capture check failed: final slot is pre-norm slot 3 (layer id 8)" in gate.output
    assert "likely cause (tested): post-norm final state" in gate.output


def test_layer_ids_shifted_by_one_are_caught(gate_against: Callable[..., Gate], run_layout: RunLayout) -> None:
    """Every slot one layer early: the final slot no longer gives the engine's logits, id 0 is not the
    embedding, and ids 0 and 2 land on the same tensor. The run page's reader shows it."""
    gate = gate_against([0, 2, 5], capture_fault="layer-shift")
    assert gate.returncode == 1, gate.output
    (final,) = gate.findings("final slot vs the engine's log-probabilities")
    assert (final["slot"], final["layer_id"], final["basis"]) == (3, 8, "inferred")
    # tp_size 1: no partial sum, so an off-by-one layer is what is left.
    assert final["cause"].startswith(OFF_BY_ONE) and "tp_size 1" in final["cause"]
    assert gate.report["final_slot"]["worst"]["error"] > 10 * gate.report["final_slot"]["worst"]["tolerance"]
    (embedding,) = gate.findings("id 0 is the embedding")
    assert (embedding["slot"], embedding["layer_id"]) == (0, 0) and embedding["cause"].startswith(OFF_BY_ONE)
    (same,) = gate.findings("distinct slots")
    assert same["slot"] == 0 and "the same tensor as slot 1" in same["message"]

    run_layout.capture_check("engine-0").mkdir(parents=True, exist_ok=True)
    run_layout.capture_check_report("engine-0").write_text(json.dumps(gate.report))
    (summary,) = capture_check_summaries(run_layout)
    assert summary["name"] == "engine-0" and not summary["passed"] and summary["embedding"]["equal"] is False
    assert summary["worst"] == gate.report["final_slot"]["worst"] and summary["positions"] > 0
    assert [s["layer_id"] for s in summary["slots"]] == [0, 2, 5, 8]
    assert len(summary["findings"]) == 3 and all("likely cause" in text for text in summary["findings"])


def test_a_tensor_parallel_partial_sum_is_caught(gate_against: Callable[..., Gate]) -> None:
    """One of 2 ranks' shares: the final slot's mismatch is put on the partial sum because the engine
    reports tp_size 2; id 0 holding only one vocabulary shard's rows is a tested partial sum."""
    gate = gate_against([0, 4, 6], capture_fault="partial-sum")
    assert gate.returncode == 1, gate.output
    assert gate.report["engine"]["tp_size"] == 2
    (final,) = gate.findings("final slot vs the engine's log-probabilities")
    assert final["cause"].startswith(PARTIAL_SUM) and "tp_size 2" in final["cause"] and final["basis"] == "inferred"
    (embedding,) = gate.findings("id 0 is the embedding")
    assert embedding["cause"] == PARTIAL_SUM_EMBEDDING and embedding["basis"] == "tested"
    assert "likely cause (inferred): tensor-parallel partial sum" in gate.output


def test_a_radix_cache_is_caught(gate_against: Callable[..., Gate]) -> None:
    """The logprob requests cannot hit the cache (SGLang caps reuse at logprob_start_len 0), the
    extractor's own request can: the gate sends one and sees the reused tokens."""
    gate = gate_against([2, 4, 5], capture_fault="radix-cache")
    assert gate.returncode == 1, gate.output
    assert gate.report["final_slot"]["passed"] and gate.report["engine"]["disable_radix_cache"] is False
    (finding,) = gate.findings("extraction request")
    assert finding["cause"] == RADIX_CACHE and finding["basis"] == "tested"
    assert gate.report["extraction_request"]["cached_tokens"] == gate.report["extraction_request"]["tokens"] - 1
    assert "reused" in finding["message"] and "--disable-radix-cache" in gate.output


def test_bad_flags_name_the_flag(tiny_model: Path, run_layout: RunLayout, tmp_path: Path) -> None:
    base = ["--dataset", str(run_layout.dataset), "--server", "http://127.0.0.1:9", "--dump-dir", str(tmp_path),
            "--verifier", str(tiny_model)]
    for flags, fragment in (
        (["--aux-layer-ids", "2,9"], "aux layer ids [9] are outside 0..8"),
        (["--aux-layer-ids", "2,4", "--verify-rows", "0"], "--verify-rows"),
        # More rows than the dataset has: refused before any request, never a silently smaller check.
        (["--aux-layer-ids", "2,4", "--verify-rows", str(ROWS + 1)],
         f"--verify-rows {ROWS + 1} (Param verify_rows): the dataset {run_layout.dataset} has only {ROWS} rows"),
    ):
        done = subprocess.run([sys.executable, "-m", "eagleflow", "verify-capture", *base, *flags],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 2 and fragment in done.stderr, done.stderr
