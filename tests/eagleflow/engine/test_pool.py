"""Several engines per run: the plan, and which engine a shard takes, probed over real HTTP.

A ready engine is a real HTTP endpoint answering ``/health_generate`` 200; a remote engine that
is down is a port nobody listens on; a launched engine that died is a pid that has exited.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from eagleflow.engine.pool import NoEngineReady, choose_engine, engines_from_xcom, first_reachable, plan_engines
from eagleflow.engine.process import ServerInfo, free_port


def engine(name: str, url: str, pid: int | None = None, host: str = "") -> ServerInfo:
    return ServerInfo(url=url, pid=pid, host=host, log_path="", dump_dir="/dumps", name=name)


def exited_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_the_plan_names_launched_engines_with_their_ports_or_lists_the_remote_ones() -> None:
    assert plan_engines(2, [], 30000) == [
        {"name": "engine-0", "index": 0, "url": None, "port": 30000},
        {"name": "engine-1", "index": 1, "url": None, "port": 30001},
    ]
    assert [e["port"] for e in plan_engines(3, [], 0)] == [0, 0, 0]
    remote = plan_engines(5, ["http://a:1", "http://b:2"], 30000)  # num_engines does not apply to remote engines
    assert [(e["name"], e["url"], e["port"]) for e in remote] == [("engine-0", "http://a:1", None), ("engine-1", "http://b:2", None)]


def test_shards_spread_over_ready_engines_in_turn(health) -> None:
    health.status = 200
    engines = [engine("engine-0", health.url), engine("engine-1", health.url + "/"), engine("engine-2", health.url)]
    chosen = [choose_engine(engines, shard)[0].name for shard in range(6)]
    assert chosen == ["engine-0", "engine-1", "engine-2", "engine-0", "engine-1", "engine-2"]


def test_the_shards_of_a_dead_or_unreachable_engine_go_to_the_ready_ones(health) -> None:
    health.status = 200
    here = socket.gethostname()
    engines = [
        engine("engine-0", health.url, pid=os.getpid(), host=here),
        engine("engine-1", f"http://127.0.0.1:{free_port()}", pid=exited_pid(), host=here),  # launched here, died
        engine("engine-2", health.url),
        engine("engine-3", f"http://127.0.0.1:{free_port()}"),  # remote, refuses connections
    ]
    chosen, passed_over = choose_engine(engines, shard_index=1)
    assert chosen.name in {"engine-0", "engine-2"}
    assert any("engine-1" in line and "dead" in line for line in passed_over), passed_over
    assert any("engine-3" in line and "starting" in line for line in passed_over), passed_over
    # a ready engine keeps its own shards; the dead ones' shards are shared out over the ready two
    assert [choose_engine(engines, shard)[0].name for shard in (0, 2)] == ["engine-0", "engine-2"]
    assert [choose_engine(engines, shard)[0].name for shard in (1, 3, 5, 7)] == ["engine-0", "engine-2"] * 2


def test_an_engine_launched_on_another_machine_on_its_loopback_is_never_chosen_from_here(health) -> None:
    health.status = 200
    # Its URL would reach whatever listens on this machine's port: the reason must be its host, not a probe.
    elsewhere = engine("engine-1", health.url, pid=4242, host="gpu-node-2")
    chosen, passed_over = choose_engine([engine("engine-0", health.url), elsewhere], shard_index=1)
    assert chosen.name == "engine-0"
    assert passed_over == [f"engine-1 at {health.url} runs on gpu-node-2, reachable only there"]


def test_no_ready_engine_says_why_for_each(health) -> None:
    health.status = 503
    engines = [engine("engine-0", health.url), engine("engine-1", f"http://127.0.0.1:{free_port()}")]
    with pytest.raises(NoEngineReady) as none:
        choose_engine(engines, shard_index=0)
    assert len(none.value.reasons) == 2
    assert "engine-0" in none.value.reasons[0] and "503" in none.value.reasons[0]
    assert "engine-1" in none.value.reasons[1] and "not accepting connections" in none.value.reasons[1]
    with pytest.raises(NoEngineReady, match="has no engine"):
        choose_engine([], shard_index=0)


def test_the_engine_list_xcom_reads_back_in_engine_order() -> None:
    engines = [engine("engine-0", "http://a:1"), engine("engine-1", "http://b:2")]
    assert engines_from_xcom([e.as_dict() for e in engines]) == engines
    assert engines_from_xcom(engines[1].as_dict()) == [engines[1]]  # one engine's dict: a list of one
    assert engines_from_xcom(None) == []


def test_regeneration_takes_the_first_engine_this_machine_reaches() -> None:
    elsewhere = engine("engine-0", "http://127.0.0.1:30000", pid=4242, host="gpu-node-2")
    remote = engine("engine-1", "http://gpu-node-3:30000")
    assert first_reachable([elsewhere, remote]) == remote
    with pytest.raises(NoEngineReady, match="engine-0 .* runs on gpu-node-2"):
        first_reachable([elsewhere])
    with pytest.raises(NoEngineReady, match="has no engine"):
        first_reachable([])
