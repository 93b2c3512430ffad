#!/usr/bin/env python
"""Make ``tests/fixtures/metrics/``: one real CPU training run, logged in all three metric forms.

Nothing in the fixture is typed by hand. The script builds a real run folder (docs/design.md §3.6)
under ``.cache/metrics-fixture/runs/fixture/`` with the pipeline's own steps:

1. the tiny trained verifier (cached under ``.cache/``), ``make-dataset`` conversations and
   ``prepare-dataset``;
2. the reference engine (``serve-reference``, on 127.0.0.1) and one ``extract`` per shard,
   which write the hidden states and the shard manifests ``shards/rows_S-E.json``;
3. ``python -m eagleflow train`` on that dataset: its ``train/metrics.jsonl`` is the **jsonl**
   form;
4. speculators' own CLI entry (``speculators.train.cli.main`` with only the CPU device shims,
   the same flags and seed) twice more, capturing stdout:

   * with nothing configured beforehand, speculators installs its Rich handler: the **rich**
     form (``[time] INFO train/loss_0=…,`` wrapped at 80 columns);
   * after ``logging.basicConfig()`` in the host, speculators' own setup is a no-op and the
     metric dicts reach the host's handler as reprs: the **repr** form.

Seeded CPU training is deterministic, so the three files describe the same steps with the same
numbers (to the precision each form prints); the tests check that. The run folder is kept: the
UI screenshot (``scripts/screenshot_plugin.py``) shows it.

Run: ``.venv/bin/python scripts/make_metrics_fixture.py`` (minutes on 2 cores; the tiny
verifier's first build adds more).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagleflow.engine.process import free_port  # noqa: E402
from eagleflow.layout import RunLayout, engine_name, plan_shards  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
DEFAULT_OUT = REPO / "tests" / "fixtures" / "metrics"
DEFAULT_WORK = CACHE / "metrics-fixture"

for _name, _value in {
    "HF_HOME": CACHE / "hf",
    "HF_DATASETS_CACHE": CACHE / "hf" / "datasets",
    "MPLCONFIGDIR": CACHE / "matplotlib",
}.items():
    os.environ.setdefault(_name, str(_value))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYTHONUNBUFFERED"] = "1"

# Runs speculators' own training entry in a fresh interpreter, exactly as its CLI would, with
# only the CPU device shims added. argv: <form> <speculators flags…>.
SPECULATORS_RUNNER = """
import logging, sys
form = sys.argv[1]
if form == "repr":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # the host configured logging first
import torch
if not torch.cuda.is_available():
    from eagleflow.train.speculators_entry import apply_cpu_shims
    apply_cpu_shims()
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[2:]))
"""


def say(message: str) -> None:
    print(f"[make_metrics_fixture] {message}", flush=True)


def run(command: list[str], log: Path | None = None, env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
    """Run ``command`` (an argv list), streaming or capturing its output; fail loudly."""
    shown = ["<speculators runner>" if arg == SPECULATORS_RUNNER else arg for arg in command[:6]]
    say("$ " + " ".join(shown) + (" …" if len(command) > 6 else ""))
    started = time.monotonic()
    if log is None:
        result = subprocess.run(command, cwd=cwd, env=env)
    else:
        with log.open("w", encoding="utf-8") as handle:
            result = subprocess.run(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log else ""
        raise SystemExit(f"command failed with exit code {result.returncode}: {command[:6]}\n{tail}")
    say(f"  done in {time.monotonic() - started:.0f}s")


def wait_ready(url: str, server: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    """Poll ``/health_generate`` until 200; fail with the log's tail if the engine dies."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the reference engine exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"the reference engine was not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def build_run(layout: RunLayout, model: Path, rows: int, shard_size: int, aux: list[int]) -> None:
    """Dataset, engine, one extraction per shard: the first half of the pipeline, for real."""
    py = sys.executable
    conversations = layout.root / "conversations.jsonl"
    run([py, "-m", "eagleflow", "make-dataset", "--verifier", str(model), "--out", str(conversations),
         "--rows", str(rows), "--seed", "7"])
    run([py, "-m", "eagleflow", "prepare-dataset", "--input", str(conversations), "--verifier", str(model),
         "--out", str(layout.dataset), "--max-len", "512"])

    layout.server.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    aux_text = ",".join(map(str, aux))
    engine_log = layout.engine_log(engine_name(0))
    with engine_log.open("wb") as server_log:
        server = subprocess.Popen(
            [py, "-u", "-m", "eagleflow", "serve-reference", "--model", str(model), "--dump-dir", str(layout.dump_dir),
             "--aux-layers", aux_text, "--host", "127.0.0.1", "--port", str(port), "--threads", "1"],
            cwd=REPO, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_ready(url, server, engine_log)
        for shard in plan_shards(rows, shard_size):
            run([py, "-m", "eagleflow", "extract", "--dataset", str(layout.dataset), "--server", url,
                 "--engine-name", engine_name(0), "--dump-dir", str(layout.dump_dir), "--rows", f"{shard['start']}:{shard['end']}", "--verifier", str(model),
                 "--aux-layer-ids", aux_text, "--manifest", str(layout.shard_manifest(str(shard["name"]))),
                 "--server-pid", str(server.pid), "--concurrency", "2"],
                log=layout.root / f"extract-{shard['name']}.log")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture folder to write")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch folder (model data, runs)")
    parser.add_argument("--rows", type=int, default=96, help="conversations in the tiny dataset")
    parser.add_argument("--shard-size", type=int, default=32, help="rows per extraction shard")
    parser.add_argument("--epochs", type=int, default=4, help="training epochs")
    args = parser.parse_args()

    from eagleflow.demo import demo_paths
    from sglang_patch.layer_ids import default_aux_layer_ids
    from eagleflow.demo.tiny_model import TinyModelConfig, make_tiny_model
    from eagleflow.verifier.config import config_int

    work = args.work.absolute()
    layout = RunLayout.of(work / "runs", "fixture")
    model = make_tiny_model(TinyModelConfig(out=Path(demo_paths(CACHE / "demo")["model_path"])))  # the demo's
    aux = default_aux_layer_ids(config_int(model, "num_hidden_layers"))
    marker = layout.root / "extracted.done"
    if not marker.exists() or marker.read_text() != f"{args.rows} {args.shard_size}\n":
        shutil.rmtree(layout.root, ignore_errors=True)
        layout.root.mkdir(parents=True)
        build_run(layout, model, args.rows, args.shard_size, aux)
        marker.write_text(f"{args.rows} {args.shard_size}\n")
    dataset = layout.dataset

    # 3. The real step: its metrics.jsonl is the jsonl form.
    train_dir = layout.train.root
    shutil.rmtree(train_dir, ignore_errors=True)
    run([
        sys.executable, "-m", "eagleflow", "train", "--dataset", str(dataset), "--verifier", str(model),
        "--out", str(train_dir), "--aux-layer-ids", ",".join(map(str, aux)), "--epochs", str(args.epochs),
        "--draft-vocab-size", "512", "--total-seq-len", "512", "--num-workers", "0", "--device", "cpu",
        "--lr", "3e-3", "--seed", "42",
    ], log=layout.root / "eagleflow-train.out")

    # 4. speculators' own entry, same flags (the real step's saved config), in the two logging set-ups.
    # Its logs print paths (config, checkpoints, warnings from site-packages); the child sees only
    # a neutral folder of symlinks, so no path of this machine ends up in the committed files.
    from eagleflow.layout import TrainLayout
    from eagleflow.train.child import resolve_device, speculators_flags
    from eagleflow.train.config import TrainConfig
    from eagleflow.train.speculators_support import installed_release
    from eagleflow.train.verifier_head import prepare_verifier

    neutral = Path(tempfile.gettempdir()) / "eagleflow-fixture"
    shutil.rmtree(neutral, ignore_errors=True)
    neutral.mkdir()
    for name, target in (("venv", Path(sys.prefix)), ("model", model), ("dataset", layout.dataset), ("work", work)):
        (neutral / name).symlink_to(target, target_is_directory=True)
    python = str(neutral / "venv" / "bin" / "python")

    cfg = TrainConfig.model_validate_json(TrainLayout(train_dir).config.read_text())
    logs: dict[str, Path] = {}
    for form in ("rich", "repr"):
        shutil.rmtree(work / f"train-{form}", ignore_errors=True)
        paths = TrainLayout(neutral / "work" / f"train-{form}")
        paths.root.mkdir(parents=True)
        form_cfg = cfg.model_copy(update={"out": paths.root, "dataset": neutral / "dataset", "verifier": neutral / "model"})
        verifier = prepare_verifier(form_cfg.verifier, paths.verifier_head)
        flags = speculators_flags(form_cfg, verifier, resolve_device(form_cfg), paths, installed_release())
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("COLUMNS", None)  # Rich's default 80 columns, as in a task log
        logs[form] = work / f"train-{form}" / f"{form}.log"
        run([python, "-u", "-c", SPECULATORS_RUNNER, form, *flags], log=logs[form], env=env, cwd=neutral)
    shutil.rmtree(neutral)

    # Publish: the three forms plus a note of how they were made.
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TrainLayout(train_dir).metrics, args.out / "metrics.jsonl")
    shutil.copyfile(logs["rich"], args.out / "rich.log")
    shutil.copyfile(logs["repr"], args.out / "repr.log")
    (args.out / "README.md").write_text(
        "Generated by `scripts/make_metrics_fixture.py`; do not edit by hand.\n\n"
        f"One tiny CPU training ({args.rows} synthetic conversations extracted through the reference engine, "
        f"{args.epochs} epochs, seed 42, the trained tiny DeepSeek-V3 verifier), logged three ways:\n\n"
        "- `metrics.jsonl`: `python -m eagleflow train`'s metrics file;\n"
        "- `rich.log`: stdout of speculators' own entry with its Rich handler (80 columns);\n"
        "- `repr.log`: stdout of the same entry after the host called `logging.basicConfig()`.\n",
        encoding="utf-8",
    )
    from eagleflow.metrics.reader import read_metrics

    for name in ("metrics.jsonl", "rich.log", "repr.log"):
        frame = read_metrics(args.out / name)
        counts = frame["kind"].value_counts().to_dict()
        say(f"{name}: {len(frame)} records {counts}, {(args.out / name).stat().st_size / 1024:.0f} KiB")
    say(f"fixture written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
