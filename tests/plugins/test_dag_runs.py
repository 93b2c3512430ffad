"""The pages' DAG runs: a DAG run that failed before writing its folder, a run's first start after a clear,
the way back from a missing run, and the links out of Airflow's plugin frame (the browser test:
``test_ui_in_airflow.py``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pendulum
from ui_run_folders import failed_task_line
from fastapi.testclient import TestClient

HTML = {"accept": "text/html"}


def when(minutes_ago: float) -> str:
    """A regex of how the pages write a time ``minutes_ago`` (minutes, UTC), set a few seconds ago."""
    now = pendulum.now("UTC").subtract(minutes=minutes_ago)
    return "(" + "|".join({re.escape(t.strftime("%Y-%m-%d %H:%M UTC")) for t in (now, now.subtract(seconds=10))}) + ")"


def row_of(index: str, name: str) -> list[str]:
    (row,) = [r for r in index.split("<tr>") if re.match(rf"<td>(<a [^>]+>)?{re.escape(name)}(</a>)?</td>", r)]
    return re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)


def test_a_dag_run_that_failed_before_writing_its_folder_is_listed_and_has_a_page(
    client: TestClient, output_root: Path, dag_runs: Callable[..., None], task_logs: Callable[..., Path]
) -> None:
    here = {"output_root": str(output_root)}
    # plan_engines refused the verifier folder (its sentence kept as XCom); a task failing after it gave another reason.
    refused = 'Param model_path ("Verifier model folder"): /models/kimi does not exist'
    dag_runs("manual__bad-model", "failed", {**here, "run_name": "never-written"}, minutes_ago=30,
             tries=(("plan_engines", 29), ("compare_drafters", 28)), failed=("plan_engines", "compare_drafters"),
             refusals={"plan_engines": refused})
    task_logs("manual__bad-model", "compare_drafters", failed_task_line("AirflowFailException", "a later task's reason"))
    dag_runs("manual__waiting", "queued", {**here, "run_name": "not-yet"}, minutes_ago=2, started_minutes_ago=None)
    dag_runs("manual__bad-name", "failed", {**here, "run_name": "../escape"}, minutes_ago=40)
    # An engine that died: its task kept no sentence, its log says why (the exception's first line).
    (output_root / "engine-only" / "server").mkdir(parents=True)  # launch_server's log, then the run failed
    dag_runs("manual__engine-died", "failed", {**here, "run_name": "engine-only"}, minutes_ago=10,
             tries=(("launch_server", 9),), failed=("launch_server",))
    task_logs("manual__engine-died", "launch_server", {"event": "Starting the engine", "level": "info"},
              failed_task_line("StepFailed", "python -m eagleflow serve exited with code 1; last lines:\nTraceback (most recent call last):"))
    dag_runs("manual__log-lost", "failed", {**here, "run_name": "log-lost"}, minutes_ago=50,
             tries=(("plan_engines", 49),), failed=("plan_engines",))  # its log is gone

    index = client.get("/", headers=HTML).text
    cells = row_of(index, "never-written")
    assert cells[0] == '<a href="runs/never-written">never-written</a>'
    assert 'href="/dags/eagleflow/runs/manual__bad-model" target="_top"' in cells[1]
    assert 'class="state failed">failed' in cells[2]
    said = refused.replace('"', "&#34;")
    assert cells[3] == ('<span class="muted">no run folder was written: the DAG run failed before its first task wrote it</span>'
                        f'<span class="error failure"><b>plan_engines</b> failed: {said}</span>')
    assert row_of(index, "not-yet")[3] == '<span class="muted">no run folder yet: no task of the DAG run has written it</span>'
    assert row_of(index, "engine-only")[3] == (
        '<span class="muted">its folder holds no shards, training or drafters yet</span><span class="error failure"><b>launch_server</b> '
        "failed: python -m eagleflow serve exited with code 1; last lines:</span>")
    assert row_of(index, "log-lost")[3].endswith('<span class="error failure"><b>plan_engines</b> failed (its log in Airflow says why)</span>')
    assert row_of(index, "../escape")[0] == "../escape"  # a name no run may use: listed, not linked, never opened
    names = re.findall(r'<tr><td>(?:<a href="runs/[^"]+">)?([^<]+)', index)
    assert names == ["demo", "not-yet", "engine-only", "never-written", "../escape", "log-lost"]  # newest change first

    page = client.get("/runs/never-written", headers=HTML)
    assert page.status_code == 200
    text = " ".join(page.text.split())
    assert ('<p class="error">No run folder was written: the DAG run failed before its first task wrote it '
            f"(<code>{output_root}/never-written</code>). Its task logs in Airflow say more: "
            '<a href="/dags/eagleflow/runs/manual__bad-model" target="_top">open the DAG run</a>.</p>'
            f' <p class="error failure"><b>plan_engines</b> failed: {said}</p>') in text
    assert page.text.count('href="/dags/eagleflow/runs/manual__bad-model" target="_top"') == 2
    assert re.search(f"started {when(30)}", page.text) and '<a href="../">eagleflow runs</a>' in page.text
    assert '<meta http-equiv="refresh"' not in page.text
    waiting = client.get("/runs/not-yet", headers=HTML).text
    assert "No run folder yet" in waiting and re.search(rf"not started yet \(triggered {when(2)}\)", waiting)
    assert '<meta http-equiv="refresh"' in waiting  # it reloads until the DAG run writes its folder
    assert "rows_0-40" in client.get("/runs/demo", headers=HTML).text  # a written run is as before


def test_the_run_page_shows_when_a_cleared_dag_run_first_started(
    client: TestClient, output_root: Path, dag_runs: Callable[..., None]
) -> None:
    """Airflow's clear sets a finished DAG run's start_date to None (then to the restart): the first start is the earliest try's."""
    tries = (("plan_engines", 119), ("extract_shard", 117), ("extract_shard", 6))  # extract_shard cleared and run again
    dag_runs("manual__cleared", "success", {"run_name": "demo"}, minutes_ago=120, started_minutes_ago=7, cleared=1, tries=tries)
    page = client.get("/runs/demo", headers=HTML).text
    assert re.search(rf"started {when(119)}, cleared 1× \(latest attempt started {when(7)}\)", page), page
    (found,) = client.get("/api/runs/demo").json()["dag_runs"]
    assert found["clear_number"] == 1 and found["first_start"] < found["start_date"]


def test_a_missing_run_is_a_404_that_leads_back_to_the_list(client: TestClient) -> None:
    page = client.get("/runs/nope", headers=HTML)
    assert page.status_code == 404 and "no run &#39;nope&#39; under the output root" in page.text
    assert '<a href="../">Back to the list of runs</a>' in page.text
    deeper = client.get("/runs/nope/files/train/train.log", headers=HTML)
    assert deeper.status_code == 404 and '<a href="../../../../">Back to the list of runs</a>' in deeper.text
    assert client.get("/runs/nope").json()["status"] == 404  # not a browser: JSON, as before


def test_the_list_links_the_dags_runs_in_airflow_and_each_page_carries_the_frame_script(client: TestClient) -> None:
    index = client.get("/", headers=HTML).text
    assert '<a href="/dags/eagleflow/runs" target="_top"' in index
    for page in (index, client.get("/runs/demo", headers=HTML).text, client.get("/runs/nope", headers=HTML).text):
        assert "window.parent.document" in page and 'closest("a[target=_top]")' in page


def test_airflow_frames_plugin_views_in_a_sandbox_that_refuses_top_navigation() -> None:
    """What base.html's script is for: the sandbox of Airflow's external-view iframe, in the UI bundle installed here.
    An Airflow that allows top navigation (or changes the frame) shows up here first."""
    import airflow

    bundle = Path(airflow.__file__).parent / "ui" / "dist" / "assets"
    sandboxes = {s for js in bundle.glob("index-*.js") for s in re.findall(r"sandbox:`(allow-[a-z -]+)`", js.read_text(errors="replace"))}
    assert "allow-scripts allow-same-origin allow-forms allow-downloads" in sandboxes, sandboxes
    assert not any("allow-top-navigation" in s or "allow-popups" in s for s in sandboxes)


def test_a_dag_runs_eagleflow_run_tab_opens_its_run_folders_page(
    client: TestClient, output_root: Path, dag_runs: Callable[..., None]
) -> None:
    """The plugin's tab on each DAG run's page in Airflow (``/dag-runs/{DAG_ID}/{RUN_ID}``) leads to its run folder's page."""
    from urllib.parse import quote

    from eagleflow.layout import run_name_from_run_id

    from_the_form = "manual__2026-12-03T23:19:16.409337+00:00"  # no run_name: the folder is named after the run id
    dag_runs("manual__named", "success", {"run_name": "demo", "output_root": str(output_root)}, minutes_ago=5)
    dag_runs(from_the_form, "failed", {}, minutes_ago=3)
    dag_runs("manual__elsewhere", "success", {"run_name": "demo", "output_root": "/srv/other-root"}, minutes_ago=4)

    tab = client.get("/dag-runs/eagleflow/manual__named", headers=HTML, follow_redirects=False)
    assert tab.status_code == 303 and tab.headers["location"] == "../../runs/demo"
    assert "rows_0-40" in client.get("/dag-runs/eagleflow/manual__named", headers=HTML).text
    derived = client.get(f"/dag-runs/eagleflow/{quote(from_the_form, safe='')}", headers=HTML)
    assert derived.url.path == f"/runs/{quote(run_name_from_run_id(from_the_form), safe='')}"
    assert derived.status_code == 200 and "No run folder was written" in derived.text  # its page says what happened
    elsewhere = client.get("/dag-runs/eagleflow/manual__elsewhere", headers=HTML)
    assert elsewhere.status_code == 404 and "writes its run folder under /srv/other-root; these pages show the runs under" in elsewhere.text
    missing = client.get("/dag-runs/eagleflow/manual__nope", headers=HTML)
    assert missing.status_code == 404 and "no DAG run &#39;manual__nope&#39; of the eagleflow DAG" in missing.text
