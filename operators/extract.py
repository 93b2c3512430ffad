"""``ShardExtractOperator``: one mapped task per shard of rows (``rows_0-2000``, …)."""

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
