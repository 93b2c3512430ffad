"""Extraction in the DAG: the capture check on the live engine, then one mapped task per shard of rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

# Names each mapped instance after its shard in the UI; pass it to .partial(): a mapped
# task takes map_index_template only from there.
SHARD_MAP_INDEX_TEMPLATE = "{{ task.shard['name'] }}"


class VerifyCaptureOperator(EagleflowStepOperator):
    """Check the engine's capture on the dataset's first rows before any shard (``python -m eagleflow verify-capture``).

    A setup of the engine, so clearing a shard re-checks a restarted engine. Fails, naming the
    check, slot, worst error and likely cause, when the captured states are not what training
    needs; writes ``<run>/verify/report.json`` either way. Returns ``{passed, report,
    worst_logprob_error, top1_agreement, findings}``.

    :param server: the engine's ``{url, pid, host, log_path, dump_dir}`` from the readiness sensor (templated).
    """

    template_fields: Sequence[str] = ("server",)
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, server: Any = None, **kwargs: Any) -> None:
        super().__init__(step="verify-capture", **kwargs)
        self.server = server

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.process import ServerInfo

        server = ServerInfo.from_dict(self.server)
        return model_to_argv(pipeline_config(context).verify_capture_config(server.url, server.dump_dir))


class ShardExtractOperator(EagleflowStepOperator):
    """Extract the hidden states of one shard from the engine (``python -m eagleflow extract``).

    Rows already complete are skipped, so a retry or a cleared instance redoes only what is
    missing. Returns ``{name, done, skipped, failed, tokens, bytes, seconds, manifest}``.

    :param shard: ``{name, start, end}`` from plan_shards (templated; mapped over).
    :param server: the engine's ``{url, pid, host, log_path, dump_dir}`` from the readiness sensor (templated).
    """

    template_fields: Sequence[str] = ("shard", "server")
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, shard: Any = None, server: Any = None, **kwargs: Any) -> None:
        super().__init__(step="extract", **kwargs)
        self.shard = shard
        self.server = server

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.pipeline import model_dir
        from eagleflow.engine.process import ServerInfo

        cfg = pipeline_config(context)
        server = ServerInfo.from_dict(self.server)
        start, end, name = int(self.shard["start"]), int(self.shard["end"]), str(self.shard["name"])
        argv = [
            "--dataset", str(cfg.layout.dataset),
            "--server", server.url,
            "--dump-dir", server.dump_dir,
            "--rows", f"{start}:{end}",
            "--model", str(model_dir(cfg)),
            "--aux-layer-ids", ",".join(str(k) for k in cfg.resolved_aux_layer_ids()),
            "--hidden-states-dtype", cfg.hidden_states_dtype,
            "--manifest", str(cfg.layout.shard_manifest(name)),
            "--concurrency", str(cfg.concurrency),
        ]
        if server.is_local:
            argv += ["--server-pid", str(server.pid)]
        return argv
