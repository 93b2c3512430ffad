"""The run page of a run that trains several drafters (``drafters/<name>/``): a block per drafter with its
training, charts and evaluation, its files in the file viewer, and the winner in the list of runs."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ui_run_folders import write_compared_run
from eagleflow.report.run_page import list_runs
from plugins.eagleflow_ui import create_app

HTML = {"accept": "text/html"}


@pytest.fixture()
def client(output_root: Path, airflow_login) -> TestClient:
    test_client = TestClient(create_app(output_root))
    test_client.cookies.set("_token", airflow_login.token)
    return test_client


@pytest.fixture()
def multi(output_root: Path) -> dict[str, Any]:
    """``<root>/multi``: two drafters, evaluated and compared (:func:`ui_run_folders.write_compared_run`)."""
    return write_compared_run(output_root / "multi", output_root / "demo" / "train-progress" / "loss.png")


def block(page: str, name: str) -> str:
    """The drafter's block of the run page."""
    return page.split(f'<section class="drafter" id="drafter-{name}">')[1].split("</section>")[0]


def test_each_drafter_is_shown_with_its_training_charts_and_evaluation(client: TestClient, multi: dict[str, Any]) -> None:
    run, layouts = multi["run"], multi["layouts"]
    response = client.get("/runs/multi", headers=HTML)
    assert response.status_code == 200
    page = response.text
    assert "<h2>Drafters</h2>" in page and "This run trains 2 drafters from one capture" in page
    # A run of several drafters has no drafter at its root: the root's empty sections are not shown.
    assert "<h2>Training</h2>" not in page and "Not evaluated yet" not in page.split("<h2>Drafters</h2>")[0]
    # The answer first: the comparison right under the run's name and DAG run, then each drafter, then the extraction.
    assert page.index("</h1>") < page.index("<h2>Drafters compared</h2>") < page.index("<h2>Drafters</h2>")
    assert page.index("<h2>Drafters</h2>") < page.index('id="drafter-dflash"') < page.index('id="drafter-eagle3"') < page.index(
        "<h2>Extraction</h2>") < page.index("<h2>Shards</h2>")
    assert not re.search(r"<h2>|<section|<div class=\"cards\">", page.split("</h1>")[1].split("<h2>Drafters compared</h2>")[0])
    compared = page.split("<h2>Drafters compared</h2>")[1].split("<h2>")[0]
    assert compared.index("Winner: <b>eagle3</b>") < compared.index("serve with SGLang: <code>--speculative") < compared.index("<table>")
    assert compared.index("Fastest at batch size 2") < compared.index('alt="Drafters compared: speedup and accept length')

    eagle3, dflash = block(page, "eagle3"), block(page, "dflash")
    assert "<h3>Drafter <code>eagle3</code> · EAGLE3</h3>" in eagle3 and "<h3>Drafter <code>dflash</code> · DFLASH</h3>" in dflash
    # Training state and the training result's facts: eagle3 recorded its time (3725 s), dflash did not.
    assert '<span class="muted">training</span><b><span class="state success">finished</span></b>' in eagle3
    assert '<span class="muted">training time</span><b>1h02m05s</b>' in eagle3
    assert '<span class="muted">training time</span><b>–</b>' in dflash and "Best checkpoint: <code>x</code>" in dflash
    # The latest metrics line of each drafter's own metrics.jsonl: eagle3's TTT steps, dflash's block slots.
    assert '<span class="muted">train loss (sum over TTT steps)</span><b>4.722</b>' in eagle3
    assert '<span class="muted">val loss (sum over TTT steps)</span><b>4.274</b>' in eagle3
    assert eagle3.count("<td>TTT step ") == 3 and "<h4>Latest metrics per TTT step</h4>" in eagle3
    val = multi["dflash_records"][-1]
    assert f'<span class="muted">val expected accept length</span><b>{val["eal"]:.3f}</b>' in dflash
    assert "<h4>Latest accuracy per block slot</h4>" in dflash and "<td>TTT step" not in dflash
    # The evaluation: accept length and single-stream speedup of the drafter's default config on the first prompt set.
    assert '<span class="muted">accept length (mean)</span><b>2</b>' in eagle3  # 1,3,1,4 on heldout
    assert '<span class="muted">speedup, one at a time</span><b>1.500×</b>' in eagle3
    assert '<span class="muted">accept length (mean)</span><b>3</b>' in dflash  # 1,1,1,8
    assert '<span class="muted">speedup, one at a time</span><b>1.300×</b>' in dflash
    assert "<td>1,3,4,8</td><td>heldout</td><td>2.500</td>" in eagle3 and "Fastest at batch size 1: <b>1,3,4,8</b>" in eagle3
    assert "<td>2,1,1,8</td><td>humaneval</td><td>3</td>" in dflash and "1,3,4,8" not in dflash
    assert "EAGLE3 drafter;" in eagle3 and "DFLASH drafter, blocks of 8;" in dflash

    # Charts: each drafter's own, linked under its folder, and each URL serves that drafter's file.
    expected = {"eagle3": [("loss", "Loss per TTT step"), ("acc", "Accuracy per TTT step")],
                "dflash": [("loss", "Loss"), ("eal", "Expected accept length"), ("acc", "Accuracy per block slot")]}
    served_charts = []
    for name, section in (("eagle3", eagle3), ("dflash", dflash)):
        found = re.findall(rf'<img src="multi/files/drafters/{name}/train-progress/(\w+)\.png\?v=\d+" alt="([^"]+)"', section)
        assert found == expected[name]
        for chart in ("accept", "sweep"):
            assert re.search(rf'<img src="multi/files/drafters/{name}/eval/{chart}\.png\?v=\d+"', section), (name, chart)
        for src in re.findall(r'<img src="multi/files/([^"?]+)\?v=\d+"', section):
            served = client.get(f"/runs/multi/files/{src}")
            assert served.status_code == 200 and served.headers["content-type"] == "image/png"
            assert served.content == (run / src).read_bytes() and src.startswith(f"drafters/{name}/")
            served_charts.append(served.content)
    assert len(served_charts) == 9 and len(set(served_charts)) == 9  # 5 training charts and 4 evaluation charts, each its own
    assert "reloads every" not in page  # every drafter has its charts and nothing runs

    summary = client.get("/api/runs/multi").json()
    assert [d["name"] for d in summary["drafters"]] == ["dflash", "eagle3"]
    assert summary["drafters"][1]["train_seconds"] == 3725.0 and summary["drafters"][1]["charts"]["loss"]["png"] == (
        "drafters/eagle3/train-progress/loss.png")


def test_each_drafters_files_are_readable_and_nothing_outside_the_run(client: TestClient, multi: dict[str, Any],
                                                                      output_root: Path) -> None:
    run = multi["run"]
    files = client.get("/api/runs/multi").json()["files"]
    for name in ("dflash", "eagle3"):
        for path in ("train/train.log", "train/metrics.jsonl", "train/result.json", "eval/report.json"):
            assert f"drafters/{name}/{path}" in files, (name, path)
    page = client.get("/runs/multi", headers=HTML).text
    listed = page.split("<h2>Files</h2>")[1]
    assert '<a href="multi/files/drafters/eagle3/eval/report.json">drafters/eagle3/eval/report.json</a>' in listed
    for name in ("dflash", "eagle3"):
        report = client.get(f"/runs/multi/files/drafters/{name}/eval/report.json")
        assert report.status_code == 200 and report.json() == json.loads((run / "drafters" / name / "eval/report.json").read_text())
        assert client.get(f"/runs/multi/files/drafters/{name}/train/train.log").text == f"{name}: step 0 loss 9.1\n"
    for outside in ("drafters/eagle3/..%2F..%2F..%2Fother-run%2Fsecret.json", "drafters/..%2F..%2F..%2Foutside.json",
                    "drafters/eagle3/drafter/sglang/model.safetensors"):
        response = client.get(f"/runs/multi/files/{outside}")
        assert response.status_code == 404 and "other run" not in response.text and "outside the output" not in response.text
    # A drafter folder linked out of the output root: not shown as a drafter, named as not read, its files refused.
    elsewhere = output_root.parent / "elsewhere-drafter"
    (elsewhere / "train").mkdir(parents=True)
    (elsewhere / "train" / "result.json").write_text('{"train_seconds": 1, "secret": "SECRET-OUTSIDE"}')
    (run / "drafters" / "escape").symlink_to(elsewhere, target_is_directory=True)
    page = client.get("/runs/multi", headers=HTML).text
    assert 'id="drafter-escape"' not in page and "SECRET-OUTSIDE" not in page and "This run trains 2 drafters" in page
    assert "drafters/escape: " in page.split("<h2>Files not read</h2>")[1]
    assert client.get("/runs/multi/files/drafters/escape/train/result.json").status_code == 404


def test_a_torn_or_wrong_drafter_file_is_named_not_fatal(client: TestClient, multi: dict[str, Any]) -> None:
    dflash = multi["layouts"]["dflash"]
    dflash.train.result.write_text('{"train_seconds": "long"}')
    (dflash.evaluation / "report.json").write_text('{"accept_length": 3}')
    multi["layouts"]["eagle3"].train.metrics.write_text('{"kind": "train", "step": 0, "lr": 0.1, "loss": 2.5}\n{"kind": "tr')
    response = client.get("/runs/multi", headers=HTML)
    assert response.status_code == 200 and client.get("/api/runs/multi").status_code == 200
    page = response.text.replace("&#39;", "'")
    section = block(page, "dflash")
    assert '<p class="error">drafters/dflash/train/result.json: not a report of the expected shape (train_seconds' in section
    assert "drafters/dflash/eval/report.json: not a report of the expected shape (accept_length" in section
    assert '<span class="muted">train loss (sum over TTT steps)</span><b>2.500</b>' in block(page, "eagle3")  # the torn last line left out
    (dflash.evaluation / "report.json").write_text('{"accept_length": {"mea')  # torn while written
    section = block(client.get("/runs/multi", headers=HTML).text, "dflash")
    assert "Not evaluated yet (<code>drafters/dflash/eval/report.json</code>" in section
    for chart in dflash.charts.iterdir():
        chart.unlink()
    page = client.get("/runs/multi", headers=HTML).text
    assert "No charts yet (<code>drafters/dflash/train-progress/*.png</code>" in block(page, "dflash")
    assert "reloads every" in page  # a drafter has no charts yet


def test_the_runs_list_shows_the_winner_of_a_run_of_several_drafters(client: TestClient, multi: dict[str, Any]) -> None:
    index = client.get("/", headers=HTML).text
    (row,) = [r.split("</tr>")[0] for r in index.split("<tr>") if 'href="runs/multi"' in r]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
    # eagle3 wins (1,3,4,8 at batch size 1): its accept length and speedup are the means over the two prompt sets.
    assert cells[6:10] == ["4.722", "4.274", '<b title="the winner of eval/compare.json">eagle3</b> 2.250', "1.450×"]
    assert "For a run of several drafters, those of the winner" in index
    (demo,) = [r.split("</tr>")[0] for r in index.split("<tr>") if 'href="runs/demo"' in r]
    assert "eagle3" not in demo and "drafters" not in demo  # a run of one drafter keeps its own figures
    headline = next(r for r in list_runs(multi["run"].parent) if r["name"] == "multi")["headline"]
    assert headline["winner"] == "eagle3" and headline["drafters"] == 2
    # Before the comparison: no winner, the count of drafters, no figures.
    (multi["run"] / "eval" / "compare.json").unlink()
    (row,) = [r.split("</tr>")[0] for r in client.get("/", headers=HTML).text.split("<tr>") if 'href="runs/multi"' in r]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
    assert cells[8:10] == ['<span class="muted">2 drafters</span> –', "–"]


def test_a_running_run_counts_the_drafters_it_plans_not_only_those_begun(
    client: TestClient, multi: dict[str, Any], output_root: Path, dag_runs: Callable[..., None]
) -> None:
    """While a run of two drafters goes, one drafter's folder may not exist yet: its plan (plan_drafters' XCom) counts."""
    run = multi["run"]
    shutil.rmtree(run / "drafters" / "eagle3")  # only dflash has begun
    (run / "eval" / "compare.json").unlink()
    plan = [{"name": name, "folder": name, "settings": {"draft_algorithm": name}} for name in ("eagle3", "dflash")]
    here = {"run_name": "multi", "output_root": str(output_root)}
    dag_runs("manual__two", "running", here, minutes_ago=5, tries=(("plan_drafters", 5),), plan=plan)

    (row,) = [r.split("</tr>")[0] for r in client.get("/", headers=HTML).text.split("<tr>") if 'href="runs/multi"' in r]
    assert re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)[8] == '<span class="muted">2 drafters</span> –'
    page = client.get("/runs/multi", headers=HTML).text
    assert "Not compared yet (<code>eval/compare.json</code>" in page and "This run trains 2 drafters from one capture, each in" in page
    assert page.index("<h2>Drafters compared</h2>") < page.index('id="drafter-dflash"') < page.index('id="drafter-eagle3"')
    waiting = block(page, "eagle3")
    assert '<span class="state queued">not started</span>' in waiting and "No training metrics yet (<code>drafters/eagle3/train/" in waiting
    assert '<meta http-equiv="refresh"' in page

    # A plan of one drafter in drafters/ (the Param lists one): said in the singular.
    shutil.rmtree(run / "drafters" / "dflash")
    dag_runs("manual__one", "running", here, minutes_ago=1, tries=(("plan_drafters", 1),), plan=plan[:1])
    (row,) = [r.split("</tr>")[0] for r in client.get("/", headers=HTML).text.split("<tr>") if 'href="runs/multi"' in r]
    assert re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)[8] == '<span class="muted">1 drafter</span> –'
    assert "This run trains 1 drafter from one capture, in its own folder" in client.get("/runs/multi", headers=HTML).text
