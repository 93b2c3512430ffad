"""The run pages read only regular files under the output root, each up to a bound: real symlinks out of
the root, a FIFO, ``/dev/zero`` and 200 MB files, against the plugin's app served by a real uvicorn on
127.0.0.1 (the Airflow login as the API server checks it)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from plugins.eagleflow_ui import create_app

SECRET = "SECRET-FROM-OUTSIDE-THE-ROOT"
HTML = {"accept": "text/html"}
BIG = 200 * 10**6  # the size of the report that took 35-38 s per page (issue 48)
QUICK_SECONDS = 2.0
PNG = b"\x89PNG\r\n\x1a\n"  # served as is: the route does not look inside


def manifest(name: str, **fields: object) -> str:
    """A shard manifest's JSON whose name and error carry :data:`SECRET`."""
    return json.dumps({"name": name, "state": "success", "done": 1, "failed": [], "error": SECRET, **fields})


@dataclass
class Server:
    """The plugin's app on a real port, and a browser logged in to Airflow."""

    url: str
    browser: requests.Session

    def get(self, path: str, **kwargs: object) -> requests.Response:
        return self.browser.get(self.url + path, **{"timeout": 20, **kwargs})  # type: ignore[arg-type]

    def run_views(self, run: str) -> tuple[requests.Response, requests.Response]:
        """The run page and its JSON, neither holding anything from outside the root."""
        page, facts = self.get(f"/runs/{run}", headers=HTML), self.get(f"/api/runs/{run}")
        assert SECRET not in page.text and SECRET not in facts.text
        return page, facts


@pytest.fixture()
def server(output_root: Path, airflow_login) -> Iterator[Server]:
    """``create_app(output_root)`` served by uvicorn on a free port of 127.0.0.1, in a thread of this process:
    the process whose Airflow auth manager signed ``airflow_login``'s token, as in the API server."""
    import uvicorn

    config = uvicorn.Config(create_app(output_root), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uvicorn_server = uvicorn.Server(config)
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = uvicorn_server.servers[0].sockets[0].getsockname()[1]
    browser = requests.Session()
    browser.cookies.set("_token", airflow_login.token)
    try:
        ready = Server(f"http://127.0.0.1:{port}", browser)
        assert ready.get("/api/runs/demo").status_code == 200  # the first request imports Airflow's login check: not timed
        yield ready
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture()
def outside(output_root: Path) -> Path:
    """A folder beside the output root holding a whole run and files, each with :data:`SECRET` in it."""
    folder = output_root.parent / "elsewhere"
    (folder / "run" / "shards").mkdir(parents=True)
    (folder / "run" / "train").mkdir()
    (folder / "run" / "shards" / "rows_0-1.json").write_text(manifest(f"rows_0-1-{SECRET}", start=0, end=1))
    (folder / "manifest.json").write_text(manifest(f"rows_120-160-{SECRET}", start=120, end=160))
    (folder / "report.json").write_text(json.dumps({"engine": SECRET, "accept_length": {"mean": 9.99}}))
    (folder / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 7, "loss": 1.0, "note": SECRET}) + "\n")
    (folder / "secret.png").write_bytes(PNG + SECRET.encode())
    (folder / "secret.log").write_text(SECRET)
    return folder


def test_a_run_folder_linked_out_of_the_root_is_not_listed_and_its_pages_are_404(
    server: Server, output_root: Path, outside: Path
) -> None:
    (output_root / "linked-run").symlink_to(outside / "run", target_is_directory=True)
    (output_root / "alias").symlink_to(output_root / "demo", target_is_directory=True)  # a link inside the root is fine
    index = server.get("/", headers=HTML)
    assert index.status_code == 200 and "linked-run" not in index.text and 'href="runs/alias"' in index.text
    for path, headers in (("/runs/linked-run", HTML), ("/api/runs/linked-run", {}),
                          ("/runs/linked-run/files/shards/rows_0-1.json", {})):
        response = server.get(path, headers=headers)
        assert response.status_code == 404, (path, response.text)
        assert "is not under the output root" in response.text and SECRET not in response.text
    assert server.get("/api/runs/linked-run").json()["status"] == 404
    page, facts = server.run_views("alias")
    assert page.status_code == facts.status_code == 200 and "rows_0-40" in page.text


def test_a_shard_manifest_linked_out_of_the_root_is_named_not_read(server: Server, output_root: Path, outside: Path) -> None:
    (output_root / "demo" / "shards" / "rows_120-160.json").symlink_to(outside / "manifest.json")
    page, facts = server.run_views("demo")
    assert page.status_code == facts.status_code == 200 and "rows_0-40" in page.text
    (shard,) = [s for s in facts.json()["shards"] if s["name"] == "rows_120-160"]
    assert shard["state"] == "unreadable" and shard["error"].startswith("shards/rows_120-160.json: not read: resolves outside")
    assert facts.json()["totals"]["shards"] == 4 and facts.json()["totals"]["rows"] == 120  # its figures are not counted
    assert "Files not read" in page.text and "shards/rows_120-160.json: resolves outside" in page.text


def test_reports_and_metrics_linked_out_of_the_root_are_named_not_read(
    server: Server, output_root: Path, outside: Path
) -> None:
    run = output_root / "demo"
    (run / "eval").mkdir()
    (run / "eval" / "report.json").symlink_to(outside / "report.json")
    (run / "verify" / "engine-0").mkdir(parents=True)
    (run / "verify" / "engine-0" / "report.json").symlink_to(outside / "report.json")
    (run / "train" / "metrics.jsonl").unlink()
    (run / "train" / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    page, facts = server.run_views("demo")
    assert page.status_code == facts.status_code == 200
    summary = facts.json()
    said = f"eval/report.json: not read: resolves outside {output_root.resolve()} (a symbolic link out of it)"
    assert summary["evaluation"] == {"error": said}
    assert summary["capture_checks"][0]["error"].startswith("verify/engine-0/report.json: not read: resolves outside")
    assert summary["metrics"]["error"].startswith("train/metrics.jsonl: not read: resolves outside")
    assert "9.99" not in page.text and "eval/report.json: not read: resolves outside" in page.text
    assert not {"eval/report.json", "verify/engine-0/report.json", "train/metrics.jsonl"} & set(summary["files"])
    for name in ("eval/report.json", "train/metrics.jsonl"):
        assert server.get(f"/runs/demo/files/{name}").status_code == 404


def test_a_report_that_is_dev_zero_or_a_fifo_is_refused_without_being_opened(server: Server, output_root: Path) -> None:
    run = output_root / "demo"
    (run / "eval").mkdir()
    (run / "eval" / "report.json").symlink_to("/dev/zero")
    os.mkfifo(run / "train" / "result.json")  # opened for reading, a FIFO without a writer blocks forever
    (run / "verify" / "engine-0").mkdir(parents=True)
    os.mkfifo(run / "verify" / "engine-0" / "report.json")
    started = time.monotonic()
    page, facts = server.run_views("demo")
    assert time.monotonic() - started < QUICK_SECONDS * 2
    assert page.status_code == facts.status_code == 200, facts.text[-500:]
    summary = facts.json()
    assert summary["evaluation"]["error"].startswith("eval/report.json: not read: resolves outside")
    assert summary["capture_checks"][0]["error"] == "verify/engine-0/report.json: not read: is a FIFO, not a regular file"
    assert "train/result.json: is a FIFO, not a regular file" in summary["refused"]
    for fifo in (run / "train" / "result.json", run / "verify" / "engine-0" / "report.json"):
        with pytest.raises(OSError) as no_reader:  # nobody holds the FIFO open for reading
            os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        assert no_reader.value.errno == errno.ENXIO
    assert server.get("/runs/demo/files/eval/report.json").status_code == 404
    assert server.get("/runs/demo/files/train/result.json", timeout=5).status_code == 404


def test_a_200_mb_report_is_named_with_its_size_and_answered_quickly(server: Server, output_root: Path) -> None:
    run = output_root / "demo"
    (run / "eval").mkdir()
    with open(run / "eval" / "report.json", "wb") as report:  # sparse: costs no disk
        report.truncate(BIG)
    started = time.monotonic()
    page, facts = server.run_views("demo")
    assert time.monotonic() - started < QUICK_SECONDS
    assert page.status_code == facts.status_code == 200
    said = "eval/report.json: not read: is 200.0 MB, over the bound of 8.0 MB"
    assert facts.json()["evaluation"] == {"error": said} and said in page.text
    index = server.get("/", headers=HTML)
    assert index.status_code == 200 and 'href="runs/demo"' in index.text


def test_a_200_mb_metrics_file_is_read_from_its_end(server: Server, output_root: Path) -> None:
    """Training appends to metrics.jsonl for days: the page reads its last 8 MB, where the latest records are."""
    metrics = output_root / "demo" / "train" / "metrics.jsonl"
    records = metrics.read_text()
    with open(metrics, "wb") as out:
        out.truncate(BIG)  # a sparse 200 MB of earlier "records"
    with open(metrics, "a") as out:
        out.write("\n" + records)
    last_train = [json.loads(line) for line in records.splitlines() if json.loads(line)["kind"] == "train"][-1]
    started = time.monotonic()
    page, facts = server.run_views("demo")
    assert time.monotonic() - started < QUICK_SECONDS
    latest = facts.json()["metrics"]
    assert latest["train"]["step"] == last_train["step"] and latest["records"] == len(records.splitlines())
    assert latest["note"].startswith("train/metrics.jsonl is 200.0 MB: these figures are from its last 8.0 MB")
    assert latest["note"] in page.text


def test_the_file_route_refuses_charts_and_logs_linked_out_of_the_root(server: Server, output_root: Path, outside: Path) -> None:
    run = output_root / "demo"
    (run / "train-progress" / "loss.png").unlink()
    (run / "train-progress" / "loss.png").symlink_to(outside / "secret.png")
    (run / "train" / "train.log").unlink()
    (run / "train" / "train.log").symlink_to(outside / "secret.log")
    (run / "server").symlink_to(outside, target_is_directory=True)  # a folder linked out: its logs are not listed
    (outside / "engine-0.log").write_text(SECRET)
    for name in ("train-progress/loss.png", "train/train.log", "server/engine-0.log", "server/secret.log"):
        response = server.get(f"/runs/demo/files/{name}")
        assert response.status_code == 404 and SECRET not in response.text, name
        assert response.json()["detail"].startswith(f"no file {name!r} in run 'demo'")
    assert "resolves outside" in server.get("/runs/demo/files/train-progress/loss.png").json()["detail"]
    page, facts = server.run_views("demo")
    summary = facts.json()
    assert list(summary["charts"]) == ["acc"] and summary["files"] == ["train/metrics.jsonl"]
    assert {"train-progress/loss.png", "train/train.log", "server"} <= {r.split(":")[0] for r in summary["refused"]}
    assert "train-progress/loss.png" not in page.text.split("Files not read")[0]
    (run / "train-progress" / "acc.png").write_bytes(PNG + b"acc")
    served = server.get("/runs/demo/files/train-progress/acc.png")  # the rest is still served, streamed
    assert served.status_code == 200 and served.content == PNG + b"acc" and served.headers["content-type"] == "image/png"
