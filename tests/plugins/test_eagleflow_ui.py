"""The eagleflow UI plugin: the run page, its file route's confinement, and Airflow's login."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from eagleflow.deploy import UI_PREFIX, run_page_path
from plugins.eagleflow_ui import create_app

REPO = Path(__file__).resolve().parents[2]
HTML = {"accept": "text/html"}


# ---------------------------------------------------------------------------------------
# the run page


def test_run_page_shows_shards_charts_and_metrics(client: TestClient) -> None:
    response = client.get("/runs/demo", headers=HTML)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    # The shard table: one row per manifest, in row order, with state, rows, tokens, GB, rate.
    names = re.findall(r"<td>(rows_\d+-\d+)", page)
    assert names == ["rows_0-40", "rows_40-80", "rows_80-120"]
    assert 'class="state running"' in page and 'class="state failed"' in page
    assert "40 / 40" in page and "39 / 40" in page and "7 / 40" in page  # done + skipped of each
    assert "9,120" in page and "3.17 rows/s" in page  # the shard's tokens over every attempt; 38 rows in 12 s
    assert "8,664 this attempt" in page and "722 tok/s" in page  # the last attempt's own tokens and rate
    assert f"{9120 * 4 * 64 * 2 / 1e9:.3f}" in page  # GB
    assert "row 57" in page and "&lt;script&gt;alert(1)" in page and "<script>alert" not in page  # escaped reasons
    assert "<small>engine-1 at http://127.0.0.1:30001</small>" in page  # the engine that served the shard
    # Both charts, linked relative to the page so any mount prefix or base URL works.
    for chart in ("loss", "acc"):
        assert re.search(rf'<img src="demo/files/train-progress/{chart}\.png\?v=\d+"', page), chart
    # The latest metrics of the training run, one row per TTT step.
    metrics = client.get("/api/runs/demo").json()["metrics"]
    assert metrics["train"]["step"] is not None
    assert page.count("<td>TTT step ") == len(metrics["ttt"]) >= 2
    assert "reloads every" in page  # a shard is still running


def test_a_block_drafters_run_page_shows_eal_and_slot_accuracy(
    client: TestClient, output_root: Path, record_dflash_metrics: Callable[[Path], list[dict[str, Any]]]
) -> None:
    """A DFlash run: its eal and accuracy per block slot where an EAGLE-3 run has its TTT steps; its three charts."""
    run = output_root / "demo"
    records = record_dflash_metrics(run / "train" / "metrics.jsonl")
    val = records[-1]
    (run / "train-progress" / "eal.png").write_bytes((run / "train-progress" / "loss.png").read_bytes())
    metrics = client.get("/api/runs/demo").json()["metrics"]
    assert metrics["drafter"] == "block" and metrics["ttt"] == []
    assert metrics["val"]["eal"] == val["eal"] and metrics["val"]["full_acc"] == val["full_acc"]
    assert [p["val_acc"] for p in metrics["positions"]] == [val[f"position_{k}_acc"] for k in (1, 2, 3)]
    page = client.get("/runs/demo", headers=HTML).text
    assert "Latest accuracy per block slot" in page and "<td>TTT step" not in page
    assert f'<span class="muted">val expected accept length</span><b>{val["eal"]:.3f}</b>' in page  # 1.155
    assert f'<span class="muted">train expected accept length</span><b>{records[-2]["eal"]:.3f}</b>' in page
    rows = re.findall(r"<tr><td>slot (\d)</td><td>[\d.]+%</td><td>([\d.]+)%</td></tr>", page)
    assert rows == [(str(k), f"{100 * val[f'position_{k}_acc']:.1f}") for k in (1, 2, 3)]
    assert f"<th>all slots (full acc)</th><th>{100 * records[-2]['full_acc']:.1f}%</th><th>{100 * val['full_acc']:.1f}%</th>" in page
    charts = re.findall(r'<img src="demo/files/train-progress/(\w+)\.png\?v=\d+" alt="([^"]+)"', page)
    assert charts == [("loss", "Loss"), ("eal", "Expected accept length"), ("acc", "Accuracy per block slot")]
    # The evaluation's offline estimate of a block drafter is its eal, and the page says so.
    from eagleflow.evaluate.report import offline_estimate

    (run / "eval").mkdir()
    estimate = offline_estimate(run / "train" / "metrics.jsonl", 3)
    (run / "eval" / "report.json").write_text(json.dumps({"engine": "reference", "num_steps": 3, "offline_estimate": estimate}))
    page = client.get("/runs/demo", headers=HTML).text
    assert f"<b>{val['eal']:.3f}</b>" in page.split("Drafter evaluation")[1]
    assert "the estimate is speculators' expected accept length (eal) of validation epoch 1 (eal over 3 block slots" in page
    assert client.get("/api/runs/demo").json()["evaluation"]["offline_estimate"]["method"] == "eal"


def test_run_json_and_index(client: TestClient, output_root: Path) -> None:
    summary = client.get("/api/runs/demo").json()
    assert summary["totals"] == {
        "shards": 3, "shards_done": 1, "rows": 120, "rows_complete": 86, "rows_failed": 1,
        "tokens": 19621, "gb": pytest.approx((9120 * 512 + 9001 * 512 + 1500 * 512) / 1e9),
    }
    assert summary["charts"]["loss"]["png"] == "train-progress/loss.png"
    assert summary["files"] == ["train/train.log", "train/metrics.jsonl"]
    index = client.get("/", headers=HTML).text
    assert 'href="runs/demo"' in index and "other-run" not in index  # not a run: no shards/ or train/


def test_the_drafter_evaluation_is_shown_once_it_ran(client: TestClient, output_root: Path) -> None:
    assert "Not evaluated yet" in client.get("/runs/demo", headers=HTML).text
    evaluation = output_root / "demo" / "eval"
    evaluation.mkdir()
    report = {
        "engine": "reference", "prompts": 8, "max_new_tokens": 48, "concurrency": 2, "num_steps": 3,
        "accept_length": {"mean": 1.74, "p50": 1.54, "p90": 2.55, "per_prompt": [1.74] * 8},
        "accept_rate": 0.15, "same_tokens_as_baseline": 1.0, "versions": {"eagleflow": "0.1.0"},
        "tokens_per_s": {"single_stream": {"drafter": 51.4, "baseline": 34.8, "speedup": 1.477},
                         "concurrent": {"drafter": 76.5, "baseline": 49.9, "speedup": 1.533}},
        "offline_estimate": {"accept_length": 1.55, "from": "validation epoch 3 (full_acc_0..2)", "full_acc": [0.4, 0.1, 0.05]},
    }
    (evaluation / "report.json").write_text(json.dumps(report))
    png = (output_root / "demo" / "train-progress" / "loss.png").read_bytes()
    (evaluation / "accept.png").write_bytes(png)
    page = client.get("/runs/demo", headers=HTML).text
    assert "Drafter evaluation" in page and "Not evaluated yet" not in page
    assert "<b>1.740</b>" in page and "<b>1.540 / 2.550</b>" in page and "<b>15.0%</b>" in page
    assert "<b>1.477×</b>" in page and "51.4 vs 34.8 tokens/s" in page and "validation epoch 3" in page
    assert re.search(r'<img src="demo/files/eval/accept\.png\?v=\d+" alt="Accept length and tokens/s">', page)
    assert client.get("/runs/demo/files/eval/accept.png").content == png
    summary = client.get("/api/runs/demo").json()["evaluation"]
    assert summary["accept_length"]["mean"] == 1.74 and summary["chart"]["png"] == "eval/accept.png"
    assert "eval/report.json" in client.get("/api/runs/demo").json()["files"]
    # The sweep: a table row per config and prompt set, a disturbed figure said as such, the fastest config's flags, its chart.
    def figures(accept: float | None, speedup: float | None, disturbed: bool = False) -> dict[str, Any]:
        return {"accept_length": {"mean": accept, "p50": accept, "p90": accept, "per_prompt": []}, "accept_rate": 0.3,
                "tokens_per_s": {"median": 40.0, "min": 39.0, "max": 41.0},
                "speedup": {"median": speedup, "min": 1.1, "max": 9.03 if disturbed else 1.3, "disturbed": disturbed}}
    flags = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"]
    report |= {"prompt_sets": ["heldout", "humaneval"], "rounds": 3, "sweep": [
        {"config": "1,0,0,0", "batch_size": 1, "steps": 0, "sets": {"heldout": figures(None, 1.0), "humaneval": figures(None, 1.0)}},
        {"config": "1,3,4,8", "batch_size": 1, "steps": 3, "sets": {"heldout": figures(2.1, 1.25), "humaneval": figures(2.4, None, True)}},
    ], "fastest": {"1": {"config": "1,3,4,8", "mean_speedup": 1.25, "sglang_flags": flags}}}
    (evaluation / "report.json").write_text(json.dumps(report))
    (evaluation / "sweep.png").write_bytes(png)
    page = client.get("/runs/demo", headers=HTML).text
    assert "Serving-config sweep" in page and "<td>1,3,4,8</td><td>humaneval</td><td>2.400</td>" in page
    assert '<span class="error">disturbed</span>' in page and "1.250×" in page
    assert "Fastest at batch size 1: <b>1,3,4,8</b>" in page and " ".join(flags) in page
    assert re.search(r'<img src="demo/files/eval/sweep\.png\?v=\d+" alt="Speedup by config and prompt set">', page)


def test_the_drafters_compared_are_shown_with_the_winner_and_its_flags(client: TestClient, output_root: Path) -> None:
    """A run of two drafters after ``compare``: a row per drafter, config and prompt set, the winner and its SGLang flags, the chart."""
    import shlex

    from drafter_runs import write_two_drafters
    from eagleflow.report.compare import main as compare

    assert "Drafters compared" not in client.get("/runs/demo", headers=HTML).text  # compare has not run
    run = output_root / "demo"
    write_two_drafters(run)
    args = {"run": run, "drafters": ["eagle3", "dflash"]}
    assert compare(argparse.Namespace(**args)) == 0
    comparison = json.loads((run / "eval" / "compare.json").read_text())
    winner = comparison["winner"]
    page = client.get("/runs/demo", headers=HTML).text
    section = page.split("<h2>Drafters compared</h2>")[1].split("<h2>")[0]
    rows = re.findall(r"<tr(?: class=\"winner\")?><td>(\w+)</td><td>(\w+)</td>\s*<td>([\d,]+)</td><td>(\d)</td><td>(\w+)</td>"
                      r"<td>([\d.]+)</td>\s*<td>([\d.]+) / ([\d.]+)</td>\s*<td>([\d.]+)×</td>\s*"
                      r"<td class=\"muted\">([\d.]+)–([\d.]+)×</td><td>([\d,]+)</td>\s*<td>([\d.]+)</td><td>([^<]+)</td></tr>", section)
    assert len(rows) == 10  # eagle3: 3 configs, dflash: 2, each on 2 prompt sets
    assert rows[2] == ("eagle3", "EAGLE3", "1,3,4,8", "1", "heldout", "2.500", "2.500", "2.500", "1.600", "1.400", "1.800", "136",
                       f"{(run / 'drafters/eagle3/drafter/sglang/model.safetensors').stat().st_size / 1e6:.2g}", "1h02m05s")
    assert rows[9][:5] == ("dflash", "DFLASH", "2,1,1,8", "2", "humaneval") and rows[9][11] == "83" and rows[9][13] == "–"
    assert section.count('<tr class="winner"><td>eagle3</td><td>EAGLE3</td>\n<td>1,3,4,8</td>') == 2
    assert "Winner: <b>eagle3</b> (EAGLE3) with config <b>1,3,4,8</b>, the fastest at the smallest batch size,\n1: 1.450×" in section
    assert f"<code>{shlex.join(winner['sglang_flags'])}</code>" in section and "--speculative-num-draft-tokens 8" in section
    assert "Fastest at batch size 2: <b>dflash</b> 2,1,1,8 (1.600×" in section
    assert "Not measured alike" not in section and "Not compared" not in section
    assert re.search(r'<img src="demo/files/eval/compare\.png\?v=\d+" alt="Drafters compared', section)
    assert client.get("/runs/demo/files/eval/compare.png").content == (run / "eval" / "compare.png").read_bytes()
    summary = client.get("/api/runs/demo").json()
    assert summary["comparison"]["winner"]["config"] == "1,3,4,8" and "eval/compare.json" in summary["files"]
    # A drafter left out and evaluations measured on other prompt sets are named, not hidden.
    comparison["missing"] = [{"drafter": "medusa", "reason": "no drafters/medusa/eval/report.json"}]
    comparison["mismatch"] = {"prompt_sets": {"eagle3": ["heldout", "humaneval"], "dflash": ["heldout"]}}
    (run / "eval" / "compare.json").write_text(json.dumps(comparison))
    section = client.get("/runs/demo", headers=HTML).text.split("<h2>Drafters compared</h2>")[1]
    assert "Not compared: medusa: no drafters/medusa/eval/report.json" in section
    assert "the drafters' prompt sets differ:\neagle3 heldout, humaneval; dflash heldout" in section


def test_online_training_figures_are_shown_live_and_from_the_result(client: TestClient, output_root: Path) -> None:
    assert "Online training" not in client.get("/runs/demo", headers=HTML).text  # trained from disk
    train = output_root / "demo" / "train"
    status = {"fetched": 57, "fetched_bytes": 3_100_000, "cached": 0, "peak_bytes": 1_234_000, "window_bytes": 2_000_000,
              "cache_bytes": 0, "data_wait_s": 4.25, "seconds": 30.0, "failure": None, "updated": 0}
    (train / "online").mkdir()
    (train / "online" / "status.json").write_text(json.dumps(status))  # while the feed runs
    page = client.get("/runs/demo", headers=HTML).text
    assert "Online training" in page and "<b>57</b>" in page and "<b>1.23 MB</b>" in page and "<b>4.2 s</b>" in page
    (train / "result.json").write_text(json.dumps({"best_checkpoint": "c", "online": {**status, "fetched": 240}}))
    summary = client.get("/api/runs/demo").json()["online"]
    assert summary["fetched"] == 240 and summary["peak_bytes"] == 1_234_000 and summary["window_bytes"] == 2_000_000


def test_regeneration_is_shown_with_the_conversations_it_shortened(client: TestClient, output_root: Path) -> None:
    assert "<h2>Regeneration</h2>" not in client.get("/runs/demo", headers=HTML).text  # this run did not regenerate
    regenerated = output_root / "demo" / "regenerated"
    regenerated.mkdir()
    summary = {"source": "chat.jsonl", "regenerated": "conversations.jsonl", "rows": 119, "skipped_rows": 1,
               "shortened_conversations": 23, "dropped_turns": 161, "capped_answers": 23, "context_length": 4096,
               "temperature": 0.0, "max_new_tokens": 512, "verifier": "tiny-model", "seconds": 503.2}
    (regenerated / "regenerate.json").write_text(json.dumps(summary))
    (regenerated / "skipped_rows.jsonl").write_text(json.dumps({"row": 95, "reason": "its first prompt is 4100 tokens"}) + "\n")
    page = client.get("/runs/demo", headers=HTML).text
    assert "<h2>Regeneration</h2>" in page
    for label, value in (("conversations", "119"), ("shortened to fit the context", "23"), ("turns dropped", "161"),
                         ("answers capped", "23"), ("rows left out", "1")):
        assert f'<span class="muted">{label}</span><b>{value}</b>' in page, label
    assert "context length of 4,096 tokens" in page and "up to 512 tokens each" in page
    facts = client.get("/api/runs/demo").json()
    assert facts["regeneration"]["shortened_conversations"] == 23 and facts["regeneration"]["dropped_turns"] == 161
    assert {"regenerated/regenerate.json", "regenerated/skipped_rows.jsonl"} <= set(facts["files"])


def capture_report(passed: bool, findings: list[str]) -> dict[str, Any]:
    """A ``verify/<engine>/report.json`` shaped as ``verify-capture`` writes it (figures of a demo run's size)."""
    slots = [
        {"slot": i, "layer_id": k, "mean_token_norm": n, "std": sd, "nearest_slot": near, "nearest_distance": d}
        for i, (k, n, sd, near, d) in enumerate([(0, 0.7821, 0.0978, 1, 0.6312), (2, 3.914, 0.4891, 0, 0.6312),
                                                 (5, 9.507, 1.188, 1, 0.7734), (8, 12.18, 1.522, 2, 0.4466)])
    ]
    slots[-1]["normed_rms_range"] = [0.2011, 0.5307]
    worst = {"row": 2, "position": 17, "token": 41, "host": -0.5103, "engine": -0.5156, "error": 0.0053, "tolerance": 0.0641}
    return {
        "passed": passed, "engine": {"url": "http://127.0.0.1:30000", "version": "reference", "tp_size": 1},
        "rows": 4, "rows_checked": 4, "tokens": 812, "layer_ids": [0, 2, 5, 8],
        "tolerance": {"atol": 0.02, "rtol": 2.0**-7, "top_logprobs_num": 5}, "hidden_states_dtype": "bf16",
        "final_slot": {"positions": 812, "top1_agree": 812, "top1_agreement": 1.0, "worst_ratio": 0.083, "worst": worst,
                       "passed": passed},
        "embedding": {"slot": 0, "rows": 4, "equal": passed, "max_abs_diff": 0.0 if passed else 0.25},
        "slots": slots, "extraction_request": {"cached_tokens": 0, "tokens": 203, "max_relative_difference": 0.0},
        "findings": [{"check": "id 0 is the embedding", "text": text} for text in findings], "seconds": 3.1,
    }


def test_the_capture_check_is_shown_once_it_ran(client: TestClient, output_root: Path) -> None:
    assert "Not checked yet" in client.get("/runs/demo", headers=HTML).text
    verify = output_root / "demo" / "verify" / "engine-0"
    verify.mkdir(parents=True)
    (verify / "report.json").write_text(json.dumps(capture_report(True, [])))
    page = client.get("/runs/demo", headers=HTML).text
    assert "Capture check" in page and "Not checked yet" not in page and 'class="state success">passed' in page
    # The final slot against the engine: worst error / its tolerance, top-1 agreement, where, the tolerance rule.
    assert "<b>0.0053 <span class=\"muted\">/ 0.064</span></b>" in page and "<b>100.0%</b>" in page
    assert "(worst at row 2, position 17)" in page and "tolerance 0.020 + 0.00781 × max|logit|" in page
    assert "Final slot RMS with the norm weight divided out: 0.201–0.531" in page
    # One table row per slot with its layer id and norms.
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([\d.]+)</td>", page)
    assert rows == [("0", "0", "0.782"), ("1", "2", "3.914"), ("2", "5", "9.507"), ("3", "8", "12.180")]
    summary = client.get("/api/runs/demo").json()
    (check,) = summary["capture_checks"]
    assert check["name"] == "engine-0" and check["passed"] and check["worst"]["error"] == 0.0053
    assert "verify/engine-0/report.json" in summary["files"] and "<h3>engine-0</h3>" not in page

    finding = "id 0 is the embedding slot 0 (layer id 0): differs by up to 0.25; likely cause (inferred): off-by-one <layer>"
    (verify / "report.json").write_text(json.dumps(capture_report(False, [finding])))
    page = client.get("/runs/demo", headers=HTML).text
    assert 'class="state failed">failed' in page and "<b>no</b>" in page  # id 0 = embedding
    assert '<li class="error">id 0 is the embedding slot 0 (layer id 0): differs by up to 0.25' in page
    assert "off-by-one &lt;layer&gt;" in page and "<layer>" not in page


def test_unreadable_manifest_is_shown_not_fatal(client: TestClient, output_root: Path) -> None:
    (output_root / "demo" / "shards" / "rows_120-160.json").write_text('{"name": "rows_120-16')
    page = client.get("/runs/demo", headers=HTML).text
    assert 'class="state unreadable"' in page and "rows_120-160.json" in page


WRONG_SHAPES = [
    ("shards/rows_120-160.json", "[]", "expected a JSON object, got list"),
    ("shards/rows_120-160.json", '{"name": "rows_120-160", "done": "many"}', "field 'done' is str"),
    ("shards/rows_120-160.json", '{"name": "rows_120-160", "failed": 5}', "field 'failed' is int"),
    ("shards/rows_120-160.json", '{"name": "rows_120-160", "start": "a"}', "field 'start' is str"),
    ("shards/rows_120-160.json", '{"name": "rows_120-160", "end": 1e400}', "field 'end' is float"),
    ("eval/report.json", '{"accept_length": 3}', "eval/report.json: not a report of the expected shape (accept_length"),
    ("eval/report.json", '{"tokens_per_s": {"single_stream": 4}}', "(tokens_per_s.single_stream"),
    ("eval/report.json", '{"accept_length": {"mean": "long"}}', "(accept_length.mean"),
    ("eval/report.json", '{"offline_estimate": 5, "accept_rate": 0.1}', "(offline_estimate"),
    ("eval/report.json", '{"versions": 3}', "(versions"),
    ("eval/compare.json", '{"drafters": [{"label": 3}]}', "eval/compare.json: not a report of the expected shape (drafters.0.label"),
    ("eval/compare.json", '{"winner": {"config": "1,3,1,4", "mean_speedup": "fast"}}', "(winner.mean_speedup"),
    ("verify/engine-0/report.json", '{"final_slot": []}', "verify/engine-0/report.json: not a report of the expected shape (final_slot"),
    ("verify/engine-0/report.json", '{"slots": 5}', "(slots"),
    ("verify/engine-0/report.json", '{"slots": [1]}', "(slots.0"),
    ("verify/engine-0/report.json", '{"findings": [1]}', "(findings.0"),
    ("verify/engine-0/report.json", '{"passed": true, "final_slot": {"worst": 3}}', "(final_slot.worst"),
    ("verify/engine-0/report.json", '{"passed": true, "final_slot": {"top1_agreement": 1e400}}', "(final_slot.top1_agreement"),
    ("train/result.json", "[]", None),
    ("train/result.json", '{"best_checkpoint": 5}', None),
    ("train/metrics.jsonl", '{"kind": "val", "epoch": 0, "loss": 1.5}\n', None),  # no train record yet
    ("train/metrics.jsonl", '{"kind": "train", "step": "x", "lr": [1], "loss": {}}\n', None),
]


@pytest.mark.parametrize(("name", "content", "said"), WRONG_SHAPES)
def test_valid_json_of_the_wrong_shape_is_named_not_a_500(
    client: TestClient, output_root: Path, name: str, content: str, said: str | None
) -> None:
    path = output_root / "demo" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    page = client.get("/runs/demo", headers=HTML)
    summary = client.get("/api/runs/demo")
    assert page.status_code == 200 and summary.status_code == 200, page.text[-500:]
    assert "rows_0-40" in page.text  # the rest of the run is still shown
    if said is not None:
        assert said in page.text.replace("&#39;", "'"), page.text
    if name.startswith("shards/"):
        (shard,) = [s for s in summary.json()["shards"] if s["name"] == "rows_120-160"]
        assert shard["state"] == "unreadable" and said in shard["error"]
    if name == "train/result.json":
        assert summary.json()["checkpoint"] is None


def test_files_are_served_from_the_run(client: TestClient) -> None:
    png = client.get("/runs/demo/files/train-progress/loss.png")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    svg = client.get("/runs/demo/files/train-progress/acc.svg")
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    assert client.get("/runs/demo/files/train/train.log").text.startswith("step 0")


SANDBOXED = "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; sandbox"
SCRIPTED_SVG = '<svg xmlns="http://www.w3.org/2000/svg"><script>document.title = "SCRIPT RAN"</script></svg>'


@pytest.mark.parametrize("name, content_type", [
    ("train-progress/acc.svg", "image/svg+xml"),  # with a <script>: run, it would act in Airflow's origin
    ("train-progress/loss.png", "image/png"),
    ("shards/rows_0-40.json", "text/plain; charset=utf-8"),  # shown as text, never as a document that runs
    ("train/metrics.jsonl", "text/plain; charset=utf-8"),
    ("train/train.log", "text/plain; charset=utf-8"),
])
def test_every_served_file_is_sandboxed_and_never_sniffed(
    client: TestClient, output_root: Path, name: str, content_type: str
) -> None:
    (output_root / "demo" / "train-progress" / "acc.svg").write_text(SCRIPTED_SVG)
    (output_root / "demo" / "train" / "train.log").write_text("<html><script>alert(1)</script>\n")  # HTML-looking log
    served = client.get(f"/runs/demo/files/{name}")
    assert served.status_code == 200 and served.content == (output_root / "demo" / name).read_bytes()
    assert served.headers["content-type"] == content_type
    assert served.headers["content-security-policy"] == SANDBOXED
    assert served.headers["x-content-type-options"] == "nosniff"
    assert "content-disposition" not in served.headers  # shown in the browser (charts, text), not downloaded


def test_the_plugins_own_pages_are_not_sandboxed(client: TestClient) -> None:
    """Their script must run in Airflow's frame to follow links out of it (templates/base.html)."""
    for path in ("/", "/runs/demo", "/runs/demo/files/train-progress/missing.png"):
        page = client.get(path, headers=HTML)
        assert page.headers["content-type"].startswith("text/html") and "content-security-policy" not in page.headers, path


@pytest.mark.parametrize(
    "path",
    [
        "/runs/demo/files/..%2F..%2Foutside.json",          # encoded ../ out of the output root
        "/runs/demo/files/..%2Fother-run%2Fsecret.json",    # into another run
        "/runs/demo/files/%2Fetc%2Fpasswd",                 # absolute path
        "/runs/demo/files/train-progress/..%2F..%2F..%2Foutside.json",
        "/runs/demo/files/dataset/hidden_states/hs_0.safetensors",  # inside, but never served
        "/runs/demo/files/train-progress",                  # a folder
        "/runs/demo/files/",                                # the run folder itself
        "/runs/demo/files/train-progress/missing.png",
        "/runs/nope/files/train-progress/loss.png",
    ],
)
def test_traversal_and_unservable_paths_are_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404, response.text
    assert "other run\"" not in response.text and "outside the output root" not in response.text
    assert response.json()["status"] == 404


@pytest.mark.parametrize("path", ["/runs/%2E%2E/files/outside.json", "/runs/.hidden", "/api/runs/-x"])
def test_bad_run_names_are_400(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 400 and "run name" in response.json()["detail"]


def test_symlink_out_of_the_root_is_404(client: TestClient, output_root: Path) -> None:
    link = output_root / "demo" / "train-progress" / "escape.json"
    link.symlink_to(output_root.parent / "outside.json")
    assert client.get("/runs/demo/files/train-progress/escape.json").status_code == 404
    run_link = output_root / "linked-run"
    run_link.symlink_to(output_root.parent, target_is_directory=True)
    assert client.get("/runs/linked-run/files/outside.json").status_code == 404


# ---------------------------------------------------------------------------------------
# authentication: Airflow's own login decides


def test_unauthenticated_requests_are_rejected(output_root: Path, airflow_login) -> None:
    anonymous = TestClient(create_app(output_root))
    for path in ("/", "/runs/demo", "/api/runs/demo", "/runs/demo/files/train-progress/loss.png"):
        response = anonymous.get(path)
        assert response.status_code == 401, path
        assert response.json() == {"detail": "Not authenticated", "status": 401}
    page = anonymous.get("/runs/demo", headers=HTML)
    assert page.status_code == 401 and "Log in to Airflow" in page.text and "rows_0-40" not in page.text


def test_forged_expired_and_revoked_tokens_are_rejected(output_root: Path, airflow_login) -> None:
    app = create_app(output_root)
    forged = TestClient(app, cookies={"_token": airflow_login.token[:-4] + "abcd"})
    assert forged.get("/runs/demo").status_code in (401, 403)
    bearer = TestClient(app, headers={"Authorization": "Bearer not-a-jwt"})
    assert bearer.get("/runs/demo").status_code in (401, 403)
    good_bearer = TestClient(app, headers={"Authorization": f"Bearer {airflow_login.new_token()}"})
    assert good_bearer.get("/api/runs/demo").status_code == 200
    revoked = airflow_login.new_token()
    assert TestClient(app, cookies={"_token": revoked}).get("/api/runs/demo").status_code == 200
    airflow_login.auth_manager.revoke_token(revoked)
    assert TestClient(app, cookies={"_token": revoked}).get("/api/runs/demo").status_code in (401, 403)


# ---------------------------------------------------------------------------------------
# settings and errors


def test_output_root_from_env_or_airflow_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_login) -> None:
    monkeypatch.setenv("EAGLEFLOW_OUTPUT_ROOT", str(tmp_path / "from-env"))
    assert create_app().state.output_root == (tmp_path / "from-env").resolve()
    monkeypatch.delenv("EAGLEFLOW_OUTPUT_ROOT")
    monkeypatch.setenv("AIRFLOW__EAGLEFLOW__OUTPUT_ROOT", str(tmp_path / "from-config"))
    assert create_app().state.output_root == (tmp_path / "from-config").resolve()
    monkeypatch.delenv("AIRFLOW__EAGLEFLOW__OUTPUT_ROOT")
    unconfigured = TestClient(create_app(), cookies={"_token": airflow_login.token})
    response = unconfigured.get("/runs/demo")
    assert response.status_code == 503 and "EAGLEFLOW_OUTPUT_ROOT" in response.json()["detail"]
    assert unconfigured.get("/runs/demo", headers=HTML).text.count("EAGLEFLOW_OUTPUT_ROOT") == 1


# ---------------------------------------------------------------------------------------
# the plugin as Airflow loads it


def test_airflow_loads_the_plugin_folder_and_mounts_the_app(
    output_root: Path, airflow_login, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.api_fastapi.app import RESERVED_URL_PREFIXES
    from airflow.plugins_manager import _load_plugins_from_plugin_directory

    monkeypatch.setenv("EAGLEFLOW_OUTPUT_ROOT", str(output_root))
    before = set(sys.modules)
    try:
        # Exactly what Airflow does with [core] plugins_folder: every .py file as a top-level module.
        plugins, errors = _load_plugins_from_plugin_directory(plugins_folder=str(REPO / "plugins"))
    finally:
        for name in set(sys.modules) - before:
            if name in ("eagleflow_plugin", "eagleflow_ui", "eagleflow_dag_runs", "__init__"):
                del sys.modules[name]
    assert errors == {}
    (plugin,) = [p for p in plugins if p.name == "eagleflow"]
    (app_spec,) = plugin.fastapi_apps
    view, tab = plugin.external_views
    assert app_spec["url_prefix"] == UI_PREFIX and not any(UI_PREFIX.startswith(p) for p in RESERVED_URL_PREFIXES)
    assert view["href"] == f"{UI_PREFIX}/" and view["destination"] == "nav"
    # Each DAG run's page gets the tab; Airflow's UI fills in the DAG and run ids (quoted) as below.
    assert tab["destination"] == "dag_run" and tab["url_route"] != view["url_route"]
    # Mounted as the API server mounts plugin apps (airflow.api_fastapi.app.init_plugins).
    server = FastAPI()
    server.mount(app_spec["url_prefix"], app_spec["app"])
    browser = TestClient(server, cookies={"_token": airflow_login.token})
    page = browser.get(run_page_path("demo"), headers=HTML)
    assert page.status_code == 200 and "rows_80-120" in page.text
    # The page's relative chart links resolve under the mount point.
    src = re.search(r'<img src="([^"]+)"', page.text).group(1)
    assert browser.get(f"{UI_PREFIX}/runs/{src}").headers["content-type"] == "image/png"
    assert TestClient(server).get(run_page_path("demo")).status_code == 401
    other_dag = browser.get(tab["href"].replace("{DAG_ID}", "etl").replace("{RUN_ID}", quote("manual__1+0", safe="")), headers=HTML)
    assert other_dag.status_code == 404 and "DAG &#39;etl&#39; is not eagleflow&#39;s" in other_dag.text
    assert json.loads(TestClient(server).get(f"{UI_PREFIX}/api/runs/demo").text)["status"] == 401


# ---------------------------------------------------------------------------------------
# the DAG runs behind a run folder (Airflow's metadata database)


def test_the_run_page_links_its_dag_run_and_the_list_shows_states_and_headline_figures(
    client: TestClient, output_root: Path, dag_runs: Callable[..., None]
) -> None:
    page = client.get("/runs/demo", headers=HTML).text
    assert "No DAG run of this Airflow wrote this folder: it was made by <code>make demo</code>'s <code>dag.test()</code>" in page
    index = client.get("/", headers=HTML).text
    assert "no DAG run</span>" in index and "<em>No DAG run</em>: no DAG run of this Airflow wrote the folder" in index
    here = {"run_name": "demo", "output_root": str(output_root)}
    dag_runs("manual__first-try", "failed", here, minutes_ago=90)
    dag_runs("manual__cleared+again:1", "running", {"run_name": "demo"}, minutes_ago=20)  # the form's default root
    dag_runs("manual__same-name-elsewhere", "success", {"run_name": "demo", "output_root": "/srv/other-root"}, minutes_ago=5)

    page = client.get("/runs/demo", headers=HTML).text
    # The newest DAG run of this folder, linked where Airflow's UI shows it (out of the plugin's frame), with its state.
    newest = re.search(r'DAG run <a href="([^"]+)" target="_top"[^>]*><code>([^<]+)</code></a>\s*<span class="state (\w+)">', page)
    assert newest is not None, page
    assert newest.groups() == ("/dags/eagleflow/runs/manual__cleared%2Bagain%3A1", "manual__cleared+again:1", "running")
    assert "1 earlier DAG run for this folder" in page and 'href="/dags/eagleflow/runs/manual__first-try"' in page
    assert "same-name-elsewhere" not in page  # its run folder is under another output root
    assert '<meta http-equiv="refresh"' in page  # its DAG run is still running
    summary = client.get("/api/runs/demo").json()
    assert [(r["run_id"], r["state"]) for r in summary["dag_runs"]] == [("manual__cleared+again:1", "running"), ("manual__first-try", "failed")]

    # The list: each run's newest DAG run and state, and its figures at a glance.
    (evaluation := output_root / "demo" / "eval").mkdir()
    (evaluation / "report.json").write_text(json.dumps({
        "accept_length": {"mean": 1.74, "p50": 1.5, "p90": 2.5, "per_prompt": []},
        "tokens_per_s": {"single_stream": {"drafter": 51.4, "baseline": 34.8, "speedup": 1.477}},
    }))
    index = client.get("/", headers=HTML).text
    (row,) = [r for r in index.split("<tr>") if 'href="runs/demo"' in r]
    train_loss, val_loss = summary["metrics"]["train"]["loss"], summary["metrics"]["val"]["loss"]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
    assert 'href="/dags/eagleflow/runs/manual__cleared%2Bagain%3A1" target="_top"' in cells[1]
    assert 'class="state running">running' in cells[2]
    assert cells[3:10] == ["1 / 3", "86 / 120", "19,621", f"{train_loss:.3f}", f"{val_loss:.3f}", "1.740", "1.477×"]


def test_a_dag_run_url_is_airflows_own_route_under_its_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugins.eagleflow_ui import dag_run_url

    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/team")
    assert dag_run_url("manual__2026-12-02T02:05:16+00:00") == (
        "https://airflow.example.com/team/dags/eagleflow/runs/manual__2026-12-02T02%3A05%3A16%2B00%3A00"
    )
    # The route of a DAG run's page in the Airflow UI this environment serves (its React router's table).
    import airflow

    bundle = Path(airflow.__file__).parent / "ui" / "dist" / "assets"
    assert any("path:`dags/:dagId/runs/:runId`" in js.read_text(errors="replace") for js in bundle.glob("index-*.js"))
