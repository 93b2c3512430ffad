"""evaluate: the exported drafter served by a real engine process, measured against the same engine without it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from eagleflow.data.prepare import write_training_dataset
from eagleflow.engine.process import pid_alive
from eagleflow.errors import UserError
from eagleflow.evaluate.prompts import held_out_prompts, validation_start
from eagleflow.evaluate.report import offline_estimate, percentile
from eagleflow.results import find_result
from reference_engines import ENGINE_COMPUTE_FLAGS
from training_data import TrainedRun


def evaluate_argv(trained_run: TrainedRun, tiny_model: Path, drafter: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "eagleflow", "evaluate", "--dataset", str(trained_run.dataset), "--verifier", str(tiny_model),
        "--drafter", str(drafter), "--train-dir", str(trained_run.out), "--out", str(out), "--eval-rows", "4",
        "--eval-max-new-tokens", "24", "--eval-concurrency", "2", *extra,
    ]


@pytest.mark.e2e
def test_the_report_holds_the_sweep_per_prompt_set_with_trustworthy_speeds_and_the_estimate(
    trained_run: TrainedRun, tiny_model: Path, exported_drafters: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    mt_bench = tmp_path / "mt_bench.jsonl"
    # eval_rows (4) prompts: a set of fewer is refused, never cut short (issue 48).
    mt_bench.write_text(json.dumps({"turns": ["Count from one to five.", "Now count down again."]}) + "\n"
                        + "".join(json.dumps({"messages": [{"role": "user", "content": f"Say hello {n}."}]}) + "\n" for n in range(3)))
    proc = subprocess.run(
        evaluate_argv(trained_run, tiny_model, exported_drafters["trained"], out, "--eval-server-extra-args=" + ",".join(ENGINE_COMPUTE_FLAGS),
                      "--eval-sets=heldout,humaneval,file", f"--eval-prompts={mt_bench}", "--eval-rounds", "2",
                      "--eval-configs", "1,3,1,4 2,3,1,4 1,3,4,8"),
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["prompt_sets"] == ["heldout", "humaneval", "mt_bench"] and report["rounds"] == 2 and report["interleaved"]
    assert report["prompts"] == 4 and report["rows"][0] >= validation_start(120, 0.9)  # rows training never saw
    # The baseline of every batch size is added; each config is measured on each set, each on its own.
    rows = {row["config"]: row for row in report["sweep"]}
    assert sorted(rows) == ["1,0,0,0", "1,3,1,4", "1,3,4,8", "2,0,0,0", "2,3,1,4"]
    for label, row in rows.items():
        assert set(row["sets"]) == {"heldout", "humaneval", "mt_bench"}
        for name, figures in row["sets"].items():
            assert figures["prompts"] == 4
            speed = figures["speedup"]
            assert len(speed["rounds"]) == 2 and len(figures["tokens_per_s"]["rounds"]) == 2
            if row["steps"] == 0:
                assert speed["rounds"] == [1.0, 1.0] and row["sglang_flags"] == []
                continue
            lengths = figures["accept_length"]["per_prompt"]
            assert all(1.0 <= x <= row["steps"] + 1 for x in lengths), (label, name, lengths)
            assert figures["accept_length"]["p50"] == pytest.approx(percentile(lengths, 0.5))
            assert figures["same_tokens_as_baseline"] > 0.5  # greedy with and without the drafter
            # A speed above what the accept length allows is flagged, never reported.
            assert speed["bound"] == figures["accept_length"]["aggregate"]
            if speed["disturbed"]:
                assert speed["median"] is None and speed["measured"] > speed["bound"]
            else:
                assert speed["median"] == pytest.approx(statistics.median(speed["rounds"]))
                assert speed["min"] <= speed["median"] <= min(speed["max"], speed["bound"])
    assert rows["1,3,4,8"]["sglang_flags"][4:10] == ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                                                    "--speculative-num-draft-tokens", "8"]
    assert set(report["fastest"]) == {"1", "2"}
    for best in report["fastest"].values():
        assert best["sglang_flags"] == rows[best["config"]]["sglang_flags"]
    # The headline: the drafter's chain on the first set, one at a time and 2 in flight.
    assert report["accept_length"] == rows["1,3,1,4"]["sets"]["heldout"]["accept_length"]
    assert report["accept_length"]["mean"] > 1.0 and 0.0 <= report["accept_rate"] <= 1.0
    estimate = report["offline_estimate"]
    val = [json.loads(line) for line in (trained_run.out / "metrics.jsonl").read_text().splitlines() if '"val"' in line][-1]
    assert estimate["accept_length"] == pytest.approx(1 + sum(val[f"full_acc_{k}"] for k in range(report["num_steps"])))
    assert report["engine"] == "reference" and report["versions"]["speculators"]
    for chart in ("accept", "sweep"):
        assert (out / f"{chart}.png").read_bytes().startswith(b"\x89PNG")
        assert (out / f"{chart}.svg").read_text().lstrip().startswith("<?xml")
    # The sweep table and one summary line in the log, the small result for XCom, and every engine gone.
    assert any(line.startswith("evaluate: fastest at batch size 1: ") and "serve with SGLang" in line for line in proc.stdout.splitlines())
    assert any(line.startswith("evaluate: accept length ") and "offline estimate" in line for line in proc.stdout.splitlines())
    result = find_result(proc.stdout.splitlines())
    assert result["report"] == str(out / "report.json") and result["accept_length"] == report["accept_length"]["mean"]
    for label in ("baseline", "3-1-4", "3-4-8"):
        server = json.loads((out / f"engine-{label}" / "server.json").read_text())
        assert not pid_alive(int(server["pid"])), f"{label} engine {server['pid']} still running"
    assert "--speculative-eagle-topk=4" in (out / "engine-3-4-8" / "server.log").read_text()
    baseline_argv = (out / "engine-baseline" / "server.log").read_text().split("starting:")[1].splitlines()[0]
    assert "--speculative-algorithm" not in baseline_argv and "--speculative-draft-model-path" not in baseline_argv


def test_an_engine_that_dies_fails_the_step_with_its_log(
    trained_run: TrainedRun, tiny_model: Path, exported_drafters: dict[str, Path], tmp_path: Path
) -> None:
    proc = subprocess.run(
        evaluate_argv(trained_run, tiny_model, exported_drafters["trained"], tmp_path / "eval", "--eval-server-extra-args=--no-such-flag"),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2
    assert "the evaluation engine died" in proc.stderr and "unrecognized arguments: --no-such-flag" in proc.stderr
    assert not (tmp_path / "eval" / "report.json").exists()
    server = json.loads((tmp_path / "eval" / "engine-baseline" / "server.json").read_text())
    assert not pid_alive(int(server["pid"]))


def test_held_out_prompts_come_from_the_validation_rows_and_stop_at_the_answer(tmp_path: Path) -> None:
    ids = [[r, 10 + r, 20 + r, 30 + r] for r in range(10)]
    masks = [[0, 0, 1, 1]] * 9 + [[1, 1, 1, 1]]
    write_training_dataset(ids, masks, tmp_path / "dataset")
    prompts = held_out_prompts(tmp_path / "dataset", 0.8, 1)
    assert [(p.row, p.input_ids) for p in prompts] == [(8, [8, 18])]  # row 9 answers from its first token: no prompt
    # More prompts than the held-out rows give is refused, naming the Param: never a silently smaller evaluation.
    with pytest.raises(UserError, match=r'^Param eval_rows \("Held-out prompts"\) 5: .* only 1 held-out prompts .* at most 1'):
        held_out_prompts(tmp_path / "dataset", 0.8, 5)
    with pytest.raises(UserError, match="no held-out prompt"):
        held_out_prompts(tmp_path / "dataset", 0.95, 5)


def test_offline_estimate_takes_the_last_validation(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"kind": "val", "epoch": 0, "full_acc_0": 0.1, "full_acc_1": 0.0, "full_acc_2": 0.0},
        {"kind": "train", "epoch": 1, "full_acc_0": 0.9},
        {"kind": "val", "epoch": 1, "full_acc_0": 0.5, "full_acc_1": 0.25, "full_acc_2": 0.125},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert offline_estimate(metrics, 2) == {"accept_length": 1.75, "from": "validation epoch 1 (full_acc_0..1)", "full_acc": [0.5, 0.25]}
    assert offline_estimate(tmp_path / "none.jsonl", 3) is None
