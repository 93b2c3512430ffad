"""The regeneration task takes the run's engine list and asks one engine: the first this worker reaches."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from eagleflow.engine.process import ServerInfo


def test_regeneration_asks_the_first_engine_it_reaches_and_waits_for_it_by_pid(params: dict[str, Any]) -> None:
    from eagleflow.data import regenerate
    from operators.dataset import RegenerateOperator

    # engine-0 was launched on another node, on its loopback; engine-1 runs here.
    elsewhere = ServerInfo(url="http://127.0.0.1:30000", pid=4242, host="gpu-node-2", log_path="", dump_dir="", name="engine-0")
    here = ServerInfo(url="http://127.0.0.1:30001", pid=os.getpid(), host=socket.gethostname(), log_path="", dump_dir="", name="engine-1")
    operator = RegenerateOperator(task_id="regenerate_dataset", engines=[elsewhere.as_dict(), here.as_dict()])
    parser = argparse.ArgumentParser()
    regenerate.add_arguments(parser)
    argv = operator.step_argv({"params": {**params, "regenerate_responses": True}, "run_id": "test_run"})
    args = parser.parse_args(argv)
    # the wait for its warmup watches its pid, so a dead engine stops it at once
    assert (args.server, args.server_pid) == (here.url, here.pid)
