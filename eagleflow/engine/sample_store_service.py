"""Where a run's Mooncake Store lives (Param ``sample_transport`` ``mooncake``): given, or started by the run.

- Given (Param ``sample_store_conn_id``): an Airflow connection names the master (host, port) and,
  in its extra, ``admin_port`` (the master's HTTP admin server), ``metadata_server`` and optionally
  ``namespace`` and ``protocol`` (:func:`address_from_connection`). That is the choice on a cluster:
  one master every engine and trainer node reaches (docker/'s Compose runs one).
- Started by the run: on the engine's node, when its first engine launches, a ``mooncake_master``
  and a ``mooncake_http_metadata_server`` bound to 127.0.0.1 (so only for engines and trainers on that
  node), recorded in ``<run>/server/sample-store.json``, reused by the later engines, brought back on
  the same ports when found dead (the engines' store clients reconnect to the same address), and
  stopped with the run's last engine. Keys of the run live under its name.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagleflow.engine.process import free_port, pid_alive, port_held, stop_server
from eagleflow.errors import UserError
from eagleflow.files import atomic_write_json
from sglang_patch.mooncake_store import StoreAddress, master_healthy

STATE_FILE = "sample-store.json"
START_TIMEOUT_S = 60.0


def address_from_connection(conn_id: str, host: str, port: int | None, extra: str | None, namespace: str) -> StoreAddress:
    """The store the Airflow connection ``conn_id`` names: host and port of the master's RPC, the rest from its
    extra, given as the connection holds it (text: Airflow's ``extra_dejson`` turns JSON it cannot read into {}).

    :raises UserError: no host or port, or an extra that is not a JSON object (named with the connection).
    """
    where = f"Param sample_store_conn_id: Airflow connection {conn_id!r}"
    if not host or not port:
        raise UserError(f"{where} needs the Mooncake master's host and port (its RPC port, e.g. 50051)")
    fields = {"admin_port": 9003, "metadata_server": "http://host:8080/metadata", "namespace": namespace}
    try:
        extra_fields = json.loads(extra) if extra else {}
    except ValueError as exc:  # the text itself is not quoted: a connection's extra may hold a secret
        raise UserError(f"{where}: its extra is not JSON ({exc}); give an object such as {json.dumps(fields)}") from None
    if not isinstance(extra_fields, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(extra_fields), "number")
        raise UserError(f"{where}: its extra is a JSON {kind}, not an object such as {json.dumps(fields)}")
    admin = extra_fields.get("admin") or f"{host}:{extra_fields.get('admin_port', 9003)}"
    return StoreAddress(
        master=f"{host}:{port}", admin=str(admin), metadata_server=str(extra_fields.get("metadata_server") or "P2PHANDSHAKE"),
        namespace=str(extra_fields.get("namespace") or namespace), protocol=str(extra_fields.get("protocol") or "tcp"),
    )


def _tool(name: str) -> str:
    """A Mooncake program: on PATH, or beside this interpreter (a venv's bin/)."""
    found = shutil.which(name) or (str(Path(sys.executable).parent / name) if (Path(sys.executable).parent / name).exists() else None)
    if found is None:
        raise UserError(f"sample_transport mooncake: {name} is not installed here (pip install mooncake-transfer-engine-non-cuda)")
    return found


def _metadata_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}?key=eagleflow-health", timeout=2).close()
    except urllib.error.HTTPError:
        return True  # "metadata not found": it answers
    except OSError:
        return False
    return True


def _spawn(argv: list[str], log: Path) -> int:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True).pid


def _alive(state: dict[str, Any]) -> bool:
    address = StoreAddress.from_dict(state["address"])
    return pid_alive(state["master_pid"]) and pid_alive(state["metadata_pid"]) and master_healthy(address.admin) and _metadata_answers(
        address.metadata_server
    )


def read_store_state(folder: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((Path(folder) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def ensure_store(folder: Path, namespace: str, say: Callable[[str], None] = print, start_new: bool = True) -> StoreAddress | None:
    """The run's own store, started (or brought back on its ports) when it is not up; its address.

    :param folder: the run's ``server/`` folder (its record and logs go there).
    :param start_new: start one when the run has none (else only bring back the one it had: None when none).
    :raises UserError: it does not come up within a minute (the log's tail says why).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = read_store_state(folder)
    if state is None and not start_new:
        return None
    if state is not None and state.get("host") != socket.gethostname():
        return StoreAddress.from_dict(state["address"])  # another node's: its engines' node keeps it
    if state is not None:
        address = StoreAddress.from_dict(state["address"])
        if _alive(state):
            return address
        say(f"the run's sample store ({address.describe()}) is not up; starting it again on the same ports")
        _stop(state)
        master_port, admin_port = int(address.master.rsplit(":", 1)[1]), int(address.admin.rsplit(":", 1)[1])
        metadata_port = int(address.metadata_server.rsplit(":", 1)[1].split("/")[0])
    else:
        master_port, admin_port, metadata_port = free_port(), free_port(), free_port()
    _refuse_held_ports(master_port, admin_port, metadata_port)
    address = StoreAddress(
        master=f"127.0.0.1:{master_port}", admin=f"127.0.0.1:{admin_port}",
        metadata_server=f"http://127.0.0.1:{metadata_port}/metadata", namespace=namespace,
    )
    master_argv = [
        _tool("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={master_port}", "--metrics_host=127.0.0.1",
        f"--metrics_port={admin_port}", "--logtostderr",
    ]
    metadata_argv = [sys.executable, _tool("mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port", str(metadata_port), "--log-level", "WARNING"]
    state = {
        "host": socket.gethostname(), "address": address.as_dict(),
        "master_pid": _spawn(master_argv, folder / "mooncake-master.log"),
        "metadata_pid": _spawn(metadata_argv, folder / "mooncake-metadata.log"),
    }
    atomic_write_json(folder / STATE_FILE, state)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _alive(state):
        if time.monotonic() > deadline or not (pid_alive(state["master_pid"]) and pid_alive(state["metadata_pid"])):
            tail = (folder / "mooncake-master.log").read_text(errors="replace")[-1500:]
            _stop(state)
            _refuse_held_ports(master_port, admin_port, metadata_port)  # taken since the check above: say so, not the log
            raise UserError(f"the run's sample store did not come up ({address.describe()}); its log ends:\n{tail}")
        time.sleep(0.1)
    say(f"sample store: {address.describe()}, metadata server {address.metadata_server}, keys under {namespace}/")
    return address


def _refuse_held_ports(master_port: int, admin_port: int, metadata_port: int) -> None:
    """:raises UserError: one of the store's ports is held by another process (its master would exit saying other things)."""
    for port, role in ((master_port, "the Mooncake master's RPC"), (admin_port, "its HTTP admin"), (metadata_port, "the metadata server's")):
        held = port_held(port)
        if held:
            raise UserError(f"the run's sample store cannot start: {held}; it is {role} port. Stop that process and retry")


def stop_store(folder: Path) -> str:
    """Stop the run's own store (both processes) and forget it; what was done."""
    state = read_store_state(folder)
    if state is None:
        return "no sample store of the run"
    if state.get("host") != socket.gethostname():
        return f"the run's sample store runs on {state.get('host')}; left to it"
    _stop(state)
    (Path(folder) / STATE_FILE).unlink(missing_ok=True)
    return "sample store stopped"


def _stop(state: dict[str, Any]) -> None:
    for key in ("master_pid", "metadata_pid"):
        if state.get(key):
            stop_server(int(state[key]), grace=5.0)  # a process already gone is only reaped


