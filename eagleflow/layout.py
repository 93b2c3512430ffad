"""The run folder (docs/design.md §3.6): the one place that knows where each artefact lives.

::

    <output_root>/<run_name>/
      regenerated/                 the verifier's answers, when regeneration is on: rows/, conversations.jsonl, regenerate.json
      dataset/                     training dataset (§3.3) with hidden_states/; prepare.json names its input
      shards/rows_0-2000.json      per-shard manifest; shards/previous/rows_0-2000/ holds a complete shard's former
                                   files while it is re-extracted (reextract_complete_shards)
      server/engine-0.log          each engine's output (engine-0.json while it runs); server/dumps/
                                   the hooks' hand-off folder
      verify/engine-0/report.json  each engine's capture check before extraction (verify-capture)
      train/                       the training step's folder (:class:`TrainLayout`)
      train-progress/*.png, *.svg
      drafter/                     the exported drafter: sglang/, speculators/, export.json
      eval/                        its evaluation: report.json, accept.{png,svg}; compare.json and
                                   compare.{png,svg}: every drafter of the run side by side
      drafters/<name>/             with the drafters Param, each drafter's own train/,
                                   train-progress/, drafter/ and eval/ (one capture, several drafters)

The training step also runs on its own (``python -m eagleflow train --out DIR``), so the
names inside its folder belong to :class:`TrainLayout`, which :attr:`RunLayout.train` returns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.errors import UserError, excerpt_repr
from sglang_patch.sample_format import sample_file_name

# A run's folder name: one plain path component, so a run never reaches outside the output root.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_RUN_NAME = re.compile(RUN_NAME_PATTERN)
# speculators reads row i's states from <dataset>/hidden_states/hs_{i}.safetensors.
HIDDEN_STATES_DIR = "hidden_states"
CAPTURE_CHECK_REPORT = "report.json"  # in the capture check's folder, whichever --out it was given


def check_run_name(run_name: str) -> str:
    """``run_name`` if it is one plain folder name (:data:`RUN_NAME_PATTERN`), else ValueError saying so."""
    if not _RUN_NAME.match(run_name):
        raise ValueError(
            f"run name {excerpt_repr(run_name)} must be 1-128 letters, digits, '.', '_' or '-' and start with a letter or digit "
            "(one folder under the output root, never a path out of it)"
        )
    return run_name


def run_name_of(params: Mapping[str, Any], run_id: str) -> str:
    """The run folder's name of a DAG run: its ``run_name`` Param, else the name derived from its run id."""
    name = str(params.get("run_name") or "").strip()
    return name or run_name_from_run_id(run_id)


def run_name_from_run_id(run_id: str) -> str:
    """A folder name from a DAG run id (``manual__2026-11-30T16:00:00+00:00`` -> ``manual__2026-11-30T16-00-00-00-00``)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", run_id).strip("-.") or "run"
    return name[:128]


# Folders a run's Params may never write into, whatever the output root (README, "Where a run may
# write and listen"); "/" itself is refused, folders below it are not.
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")


def check_output_path(value: str, output_root_env: str | None) -> str:
    """``value`` if a run may write there, else ValueError saying why: the path policy of ``output_root``
    and ``server_dump_dir``.

    It must be absolute, must not be (or be inside) a system folder, and when the deployment sets
    ``EAGLEFLOW_OUTPUT_ROOT`` (``output_root_env``) it must be that folder or inside it, after
    symlinks and ``..`` are resolved, so neither a link nor a ``..`` leads out of it.
    """
    import os

    if not os.path.isabs(value):
        raise ValueError(f"{excerpt_repr(value)} is not an absolute path")
    resolved = Path(value).resolve()
    if resolved == Path("/") or any(resolved.is_relative_to(folder) for folder in SYSTEM_FOLDERS):
        raise ValueError(f"{excerpt_repr(value)} is a system folder (or inside one); runs write elsewhere")
    if output_root_env:
        root = Path(output_root_env).resolve()
        if not resolved.is_relative_to(root):
            shown = f" (it resolves to {resolved})" if str(resolved) != value.rstrip("/") else ""
            raise ValueError(f"{excerpt_repr(value)}{shown} is outside $EAGLEFLOW_OUTPUT_ROOT ({root}), where this deployment keeps its runs")
    return value


def hidden_states_dir(dataset: str | Path) -> Path:
    """The folder of a training dataset that holds its rows' hidden-state files."""
    return Path(dataset) / HIDDEN_STATES_DIR


ENGINE_PREFIX = "engine-"


def engine_name(index: int) -> str:
    """``engine-{index}``: the only place engine names are made (files, logs, manifests, the UI)."""
    return f"{ENGINE_PREFIX}{index}"


def shard_name(start: int, end: int) -> str:
    """``rows_{start}-{end}`` with ``end`` exclusive: the only place shard names are made."""
    return f"rows_{start}-{end}"


def plan_shards(num_rows: int, shard_size: int) -> list[dict[str, int | str]]:
    """Split ``num_rows`` rows into shards of ``shard_size`` (the last one may be shorter).

    Returns the XCom payload of docs/design.md §3.5: ``[{"name", "start", "end"}, …]``.
    """
    if shard_size < 1:
        raise UserError(f"--shard-size must be at least 1, got {shard_size}")
    return [
        {"name": shard_name(start, min(start + shard_size, num_rows)), "start": start, "end": min(start + shard_size, num_rows)}
        for start in range(0, num_rows, shard_size)
    ]


DRAFTERS_DIR = "drafters"


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run's artefacts under ``<output_root>/<run_name>``.

    ``drafter_name`` picks one drafter of a run that trains several (the ``drafters`` Param): its
    training, charts, export and evaluation live in ``drafters/<name>/``; None is the run's one
    drafter, whose folders sit in the run folder itself (as every run made before the Param).
    """

    root: Path
    drafter_name: str | None = None

    @classmethod
    def of(cls, output_root: str | Path, run_name: str) -> RunLayout:
        """Layout of ``run_name`` under ``output_root``; the name must be a plain folder name."""
        try:
            check_run_name(run_name)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        return cls(Path(output_root).absolute() / run_name)

    def for_drafter(self, name: str | None) -> RunLayout:
        """The same run seen from drafter ``name`` (None: the run's one drafter, in the run folder)."""
        if name is not None:
            try:
                check_run_name(name)
            except ValueError as exc:
                raise UserError(f"drafter name: {exc}") from exc
        return RunLayout(self.root, name)

    @property
    def drafter_root(self) -> Path:
        """The folder of this layout's drafter: ``drafters/<name>``, or the run folder for the run's one drafter."""
        return self.root if self.drafter_name is None else self.root / DRAFTERS_DIR / self.drafter_name

    @property
    def comparison(self) -> Path:
        """``eval/compare.json``: every drafter of the run measured side by side (one per run)."""
        return self.root / "eval" / "compare.json"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset"

    @property
    def hidden_states(self) -> Path:
        return hidden_states_dir(self.dataset)

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    def shard_manifest(self, name: str) -> Path:
        return self.shards / f"{name}.json"

    @property
    def server(self) -> Path:
        return self.root / "server"

    def engine_log(self, engine: str) -> Path:
        """Output of engine ``engine`` (``engine-0``, …), appended by each start."""
        return self.server / f"{engine}.log"

    def engine_state(self, engine: str) -> Path:
        """Where engine ``engine`` runs (``ServerInfo``) while it runs."""
        return self.server / f"{engine}.json"

    @property
    def engine_logs(self) -> list[Path]:
        """Every engine's log, in engine order."""
        return sorted(self.server.glob(f"{ENGINE_PREFIX}*.log"), key=lambda p: (len(p.name), p.name))

    @property
    def dump_dir(self) -> Path:
        """The hooks' hand-off folder, one for all of the run's engines (request ids are unique)."""
        return self.server / "dumps"

    @property
    def regenerated(self) -> Path:
        """The verifier's own answers to the dataset's prompts (regeneration): rows/, conversations.jsonl."""
        return self.root / "regenerated"

    @property
    def capture_checks(self) -> Path:
        """The capture checks' folder (``verify-capture``): one folder per engine, before any shard."""
        return self.root / "verify"

    def capture_check(self, engine: str) -> Path:
        """Engine ``engine``'s capture check (``engine-0``, …)."""
        return self.capture_checks / engine

    def capture_check_report(self, engine: str) -> Path:
        """What engine ``engine``'s capture check found: its figures, and on a failure the check, slot and likely cause."""
        return self.capture_check(engine) / CAPTURE_CHECK_REPORT

    @property
    def capture_check_reports(self) -> list[Path]:
        """Every engine's capture-check report, in engine order."""
        reports = self.capture_checks.glob(f"{ENGINE_PREFIX}*/{CAPTURE_CHECK_REPORT}")
        return sorted(reports, key=lambda p: (len(p.parent.name), p.parent.name))

    @property
    def drafter(self) -> Path:
        """The exported drafter: sglang/, speculators/, export.json."""
        return self.drafter_root / "drafter"

    @property
    def evaluation(self) -> Path:
        """The evaluation's report.json and charts (and its engines' logs)."""
        return self.drafter_root / "eval"

    @property
    def train(self) -> TrainLayout:
        return TrainLayout(self.drafter_root / "train")

    @property
    def charts(self) -> Path:
        return self.drafter_root / "train-progress"


@dataclass(frozen=True)
class TrainLayout:
    """Files of one training run under its folder (``<run>/train`` in a run folder)."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        """speculators' ``--save-path``: one folder per epoch, ``checkpoint_best``, ``interrupted``."""
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def result(self) -> Path:
        """The step's result (docs/design.md §3.5 train result), written when it succeeds."""
        return self.root / "result.json"

    @property
    def drafter(self) -> Path:
        """The drafter's parameter counts and shape, written when speculators builds it."""
        return self.root / "drafter.json"

    @property
    def config(self) -> Path:
        """The settings of the run in this folder; a resume must match them."""
        return self.root / "train-config.json"

    @property
    def verifier_head(self) -> Path:
        return self.root / "verifier-head"

    @property
    def lock(self) -> Path:
        """Held (flock) by the one trainer working in this folder; says which process that is."""
        return self.root / ".train.lock"

    @property
    def rendezvous(self) -> Path:
        """Training on several nodes: node-0's publication and every other node's join (``node-<i>.json``)."""
        return self.root / "rendezvous"

    def node_log(self, node: str) -> Path:
        """The log of a node other than node-0 (node-0 writes ``train.log``)."""
        return self.root / "nodes" / f"{node}.log"

    @property
    def online(self) -> Path:
        """The online feed's folder (``hidden_states_source=engine``): :class:`FeedLayout`."""
        return self.root / "online"

    @property
    def speculators_logs(self) -> Path:
        return self.root / "logs"

    @property
    def previous(self) -> Path:
        """Where a restart or an unusable left-over is moved aside, one ``<time>/`` folder each."""
        return self.root / "previous"


@dataclass(frozen=True)
class FeedLayout:
    """Files of the online feed (``hidden_states_source=engine``) under :attr:`TrainLayout.online`."""

    root: Path

    @property
    def settings(self) -> Path:
        return self.root / "feed.json"

    @property
    def ready(self) -> Path:
        """Samples fetched ahead of the trainer; each is deleted once the trainer has it."""
        return self.root / "ready"

    @property
    def cache(self) -> Path:
        """Samples kept for later epochs (``online_cache_gb``)."""
        return self.root / "cache"

    @property
    def status(self) -> Path:
        """The feed's figures: samples fetched, bytes held (peak), the trainer's data wait."""
        return self.root / "status.json"

    @property
    def journal(self) -> Path:
        """Requests sent and not yet settled; the next start (or the step) aborts them and removes their dumps."""
        return self.root / "in-flight.json"

    @property
    def failure(self) -> Path:
        """Why the feed stopped (an engine gone too long, a row the engines cannot give, a full disk)."""
        return self.root / "failed.json"

    @property
    def staging(self) -> Path:
        """A lead feed's fetched samples before they are handed to every trainer (one sample per fetcher)."""
        return self.root / "staging"

    @property
    def passes(self) -> Path:
        """Several drafters online: each pass's order as this trainer reads it (``<k>.json``), compared with the lead's."""
        return self.root / "passes"

    @property
    def heartbeat(self) -> Path:
        """Several drafters online: this trainer's feed is alive (``updated``), or has finished (``finished``)."""
        return self.root / "heartbeat.json"

    @property
    def dropped(self) -> Path:
        """Several drafters online: the lead stopped handing this trainer samples, and why (it goes on alone on retry)."""
        return self.root / "dropped.json"

    def sample(self, folder: Path, row: int) -> Path:
        """Row ``row``'s file in ``folder`` (:attr:`ready` or :attr:`cache`), named as in a dataset."""
        return folder / sample_file_name(row)
