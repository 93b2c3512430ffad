"""Training on several nodes: one ``torchrun`` per node, their ranks data-parallel (speculators' DDP).

Every node runs ``python -m eagleflow train --train-nodes N --node-rank i …`` (in the DAG: one
``train_drafter`` instance per node). They meet through the training folder, which every node
sees at the same path (its checkpoints are shared anyway):

1. node-0 does what a single node does (lock, checks, resume, vocabulary, verifier head), then
   publishes ``rendezvous/node-0.json``: a fresh rendezvous id, its address and a free port, and
   the exact command every node runs (speculators' flags included, so no node trains with
   other settings);
2. every other node waits for a publication, joins it by writing ``rendezvous/node-<i>.json``
   (the id and a nonce of its own), and waits for node-0's go;
3. once every node has joined, node-0 writes the go, listing each node's nonce, and all start
   ``torchrun --nnodes N --node-rank i --rdzv-backend static --rdzv-endpoint node-0:port``.

Why a file and not XCom: the core runs without Airflow, the retry of a node must find its
peers' current attempt (not an old XCom), and the shared folder is a requirement anyway. A
stale publication (node-0 killed) is harmless: a go names the nonces of this attempt's joins,
so no node starts on an old one, and a node that re-reads a new id joins again. A node missing
after ``rendezvous_timeout`` fails the others naming it.

Why ``--rdzv-backend static`` (c10d's TCPStore on node-0, ranks by ``--node-rank``) and not the
elastic ``c10d`` backend: that one ignores ``--node-rank`` and orders nodes by host name and
pid, so rank 0 (the only rank that writes checkpoints and metrics) could land on any node; and
eagleflow wants no elasticity: a group that lost a node fails, and Airflow retries it, resuming
from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagleflow.files import atomic_write_json
from eagleflow.layout import TrainLayout
from eagleflow.train.child import Device, TrainingFailed, TrainLog, child_env, ranks_per_node, resolve_device, run_child
from eagleflow.train.config import TrainConfig
from eagleflow.train.lock import TrainFolderLock
from eagleflow.train.resume import best_checkpoint

POLL_SECONDS = 0.2
SHUTDOWN_SECONDS = 5
PUBLICATION = "node-0"


def node_name(rank: int) -> str:
    """How a node is named in files, logs and the DAG's mapped instances: ``node-0``, ``node-1``, …"""
    return f"node-{rank}"


def node_plan(nodes: int) -> list[dict[str, Any]]:
    """The training nodes, ``[{name, rank}]``: what the DAG maps train_drafter over."""
    return [{"name": node_name(rank), "rank": rank} for rank in range(nodes)]


def drafter_node_plan(drafters: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]]:
    """Each drafter's training nodes, ``[{name, rank, drafter}]``: what the DAG maps train_drafter over.

    Named by drafter and node (``dflash``, or ``dflash/node-1`` with several nodes); a run's one
    drafter (no ``drafters`` Param) keeps the node names alone (``node-0``).
    """
    plan = []
    for drafter in drafters:
        for node in node_plan(nodes):
            if drafter.get("folder") is None:
                name = node["name"]
            else:
                name = drafter["name"] if nodes == 1 else f"{drafter['name']}/{node['name']}"
            plan.append({**node, "name": name, "drafter": drafter})
    return plan


def node_address(configured: str | None) -> str:
    """The address the other nodes reach this one at: given, else ``$EAGLEFLOW_NODE_ADDRESS``, else the host's name."""
    from eagleflow.deploy import NODE_ADDRESS_ENV

    return configured or os.environ.get(NODE_ADDRESS_ENV) or socket.getfqdn()


@dataclass
class Publication:
    """node-0's ``rendezvous/node-0.json``: where to meet, what to run, and (once all joined) the go."""

    rdzv_id: str
    host: str
    port: int
    nodes: int
    ranks_per_node: int
    entry: list[str]  # speculators_entry's argv, speculators' flags included
    nothing_to_train: bool = False
    go: dict[str, str] = field(default_factory=dict)  # node name -> the nonce of the join node-0 accepted

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or vanishing under us (written by rename, never torn)
        return None


def publish(paths: TrainLayout, publication: Publication) -> None:
    paths.rendezvous.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.rendezvous / f"{PUBLICATION}.json", asdict(publication))


def read_publication(paths: TrainLayout) -> Publication | None:
    data = _read(paths.rendezvous / f"{PUBLICATION}.json")
    return Publication(**data) if data else None


def gather_nodes(paths: TrainLayout, publication: Publication, timeout: float, say: Callable[[str], None]) -> None:
    """node-0: wait until every other node has joined ``publication``, then write the go.

    :raises TrainingFailed: a node has not joined within ``timeout`` seconds; the message names it.
    """
    others = [node_name(rank) for rank in range(1, publication.nodes)]
    say(f"rendezvous {publication.rdzv_id} at {publication.endpoint}: waiting for {', '.join(others)} (up to {timeout:.0f}s)")
    deadline = time.monotonic() + timeout
    joined: dict[str, str] = {}
    while True:
        for name in others:
            join = _read(paths.rendezvous / f"{name}.json")
            if join and join.get("rdzv_id") == publication.rdzv_id:
                joined[name] = str(join["nonce"])
        missing = [name for name in others if name not in joined]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TrainingFailed(
                f"{', '.join(missing)} never joined the rendezvous at {publication.endpoint} within {timeout:.0f}s "
                f"(Param rendezvous_timeout; joined: {', '.join(joined) or 'none'}): is its train_drafter instance "
                "running (the gpu pool needs a slot per node) and does it see this run folder?",
                1,
            )
        time.sleep(POLL_SECONDS)
    publication.go = joined
    publish(paths, publication)
    say(f"every node joined ({', '.join(others)}): starting")


def join_node_0(paths: TrainLayout, rank: int, timeout: float, say: Callable[[str], None]) -> Publication:
    """Node ``rank`` > 0: join node-0's current publication and wait for its go; return the publication.

    :raises TrainingFailed: no go naming this node's join within ``timeout`` seconds; the message says
        whether node-0 published at all.
    """
    name = node_name(rank)
    deadline = time.monotonic() + timeout
    joined_id, nonce = None, uuid.uuid4().hex
    say(f"{name}: waiting for node-0's rendezvous in {paths.rendezvous} (up to {timeout:.0f}s)")
    while True:
        publication = read_publication(paths)
        if publication is not None and publication.rdzv_id != joined_id:
            if publication.nodes <= rank:
                raise TrainingFailed(f"node-0 trains on {publication.nodes} node(s); {name} is not one of them", 2)
            joined_id, nonce = publication.rdzv_id, uuid.uuid4().hex
            paths.rendezvous.mkdir(parents=True, exist_ok=True)
            atomic_write_json(
                paths.rendezvous / f"{name}.json",
                {"rdzv_id": joined_id, "nonce": nonce, "host": socket.getfqdn(), "pid": os.getpid()},
            )
            say(f"{name}: joined rendezvous {joined_id} at {publication.endpoint}")
        if publication is not None and publication.go.get(name) == nonce:
            return publication
        if time.monotonic() > deadline:
            why = "node-0 published no rendezvous" if joined_id is None else f"node-0 did not start rendezvous {joined_id}"
            raise TrainingFailed(
                f"{name}: {why} within {timeout:.0f}s (Param rendezvous_timeout): node-0 never joined; is its "
                "train_drafter instance running, and does it see this run folder?",
                1,
            )
        time.sleep(POLL_SECONDS)


def torchrun_launcher(python: str, publication: Publication, rank: int, timeout: float) -> list[str]:
    """``python -m torch.distributed.run`` for node ``rank`` of ``publication`` (an argv list; no shell)."""
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={publication.nodes}",
        f"--node-rank={rank}",
        f"--nproc-per-node={publication.ranks_per_node}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={publication.endpoint}",
        f"--rdzv-id={publication.rdzv_id}",
        f"--rdzv-conf=timeout={int(timeout)}",
        "--max-restarts=0",  # a group that lost a node fails; Airflow retries it from the last checkpoint
        # A stopped node's ranks get this long for speculators' interrupt save before SIGKILL (torch's
        # default: 30 s). A resume uses complete epochs only, and a rank in that save's barrier would
        # hold its peers, whose node is gone, until then.
        f"--shutdown-timeout={SHUTDOWN_SECONDS}",
    ]


def new_publication(host: str, nodes: int, ranks_per_node: int, entry: list[str], nothing_to_train: bool) -> Publication:
    """A fresh rendezvous on ``host``: a new id, and a port free now (torch's store binds it once every node joined)."""
    from eagleflow.engine import free_port

    port = free_port("" if host not in ("127.0.0.1", "localhost") else "127.0.0.1")
    return Publication(uuid.uuid4().hex, host, port, nodes, ranks_per_node, entry, nothing_to_train)


def lead_nodes(
    cfg: TrainConfig, device: Device, paths: TrainLayout, entry: list[str] | None, log: TrainLog, lock: TrainFolderLock
) -> tuple[int, int | None]:
    """node-0, once the folder is ready: publish, wait for every node, run torchrun; return (exit code, signal forwarded).

    :param entry: what every rank runs (:func:`~eagleflow.train.child.entry_argv`); None: every epoch is
        done, and the other nodes are told so (they exit without training).
    """
    publication = new_publication(node_address(cfg.node_address), cfg.train_nodes, ranks_per_node(device), entry or [], entry is None)
    publish(paths, publication)
    gather_nodes(paths, publication, cfg.rendezvous_timeout, log.say)
    if entry is None:
        return 0, None
    command = torchrun_launcher(sys.executable, publication, 0, cfg.rendezvous_timeout) + entry
    return run_child(command, child_env(device), log, lock)


def follow_node_0(cfg: TrainConfig) -> dict[str, Any]:
    """A node other than node-0: join its rendezvous and run this node's ranks with node-0's command.

    It writes nothing to the training folder but its join and its log (``nodes/node-<i>.log``):
    node-0 prepared the folder, and rank 0 (on node-0) writes the checkpoints and metrics.
    Returns the train result, ``node`` and this node's log added.

    :raises TrainingFailed: node-0 never published (or never started), or this node's ranks failed.
    """
    paths = TrainLayout(cfg.out.absolute())
    name = node_name(cfg.node_rank)
    log = TrainLog(paths.node_log(name))
    try:
        log.say(f"train {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {name} of {cfg.train_nodes}, training folder {paths.root}")
        device = resolve_device(cfg)
        publication = join_node_0(paths, cfg.node_rank, cfg.rendezvous_timeout, log.say)
        if publication.nodes != cfg.train_nodes:
            raise TrainingFailed(f"node-0 trains on {publication.nodes} nodes, {name} was started for {cfg.train_nodes}", 2)
        if publication.nothing_to_train:
            log.say("node-0 says every epoch is done; nothing to train")
        else:
            if publication.ranks_per_node != ranks_per_node(device):
                raise TrainingFailed(
                    f"node-0 runs {publication.ranks_per_node} rank(s) per node, {name} would run {ranks_per_node(device)} "
                    "(Params device and gpus must fit every node)", 2,
                )
            command = torchrun_launcher(sys.executable, publication, cfg.node_rank, cfg.rendezvous_timeout) + publication.entry
            returncode, forwarded = run_child(command, child_env(device), log, None)
            if forwarded is not None:
                raise TrainingFailed(f"{name} stopped by {signal.Signals(forwarded).name}", 128 + forwarded)
            if returncode != 0:
                raise TrainingFailed(
                    f"{name}'s ranks exited with status {returncode} (see {paths.node_log(name)}); when one node stops, "
                    "the others fail at their next collective; a retry resumes from the last checkpoint", returncode,
                )
        best = best_checkpoint(paths)
        return {
            "node": name,
            "checkpoint_dir": str(paths.checkpoints),
            "best_checkpoint": str(best) if best else None,
            "metrics_path": str(paths.metrics),
            "log_path": str(paths.node_log(name)),
        }
    finally:
        log.close()
