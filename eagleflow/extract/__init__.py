"""The extraction stage: hidden states of each shard's rows, from a running engine, into the dataset.

- :mod:`~eagleflow.extract.shard`: one shard's rows, resumable (``python -m eagleflow extract``),
  with its flags in :mod:`~eagleflow.extract.config`;
- :mod:`~eagleflow.extract.dump_wait`: waiting for a request's dump (late, lost, writer behind, disk full);
- :mod:`~eagleflow.extract.handoff_reader`: where the dumps are read, the engine's folder or the run's sample store;
- :mod:`~eagleflow.extract.sample_store`: where a row's file lives, whether it is complete,
  and moving a server dump into place;
- :mod:`~eagleflow.extract.manifest`: the per-shard manifest (light: the UI reads it);
- :mod:`~eagleflow.extract.completion`: whether a shard is already complete, and re-extracting one.

The engine's client it speaks through is :mod:`eagleflow.engine.client`. The names other stages use load
lazily, so the API server reads shard manifests without torch.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "manifest": ["ShardManifest"],
        "config": ["ExtractConfig"],
        "dump_wait": ["DiskFull"],
        "row_fetch": ["RowFetcher", "SampleShape"],
        "handoff_reader": ["FolderHandOff", "HandOff", "StoreHandOff", "StoreUnreachable", "handoff_for"],
        "sample_store": ["validate_dataset"],
        "completion": ["already_complete_message", "complete_shard", "incomplete_shards"],
        "verify_config": ["VerifyCaptureConfig"],
    },
)
