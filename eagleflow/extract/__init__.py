"""The extraction stage: hidden states of each shard's rows, from a running engine, into the dataset.

- :mod:`~eagleflow.extract.shard`: one shard's rows, resumable (``python -m eagleflow extract``);
- :mod:`~eagleflow.extract.client`: the engine's ``/generate`` as the extractor speaks it;
- :mod:`~eagleflow.extract.sample_store`: where a row's file lives, whether it is complete,
  and moving a server dump into place;
- :mod:`~eagleflow.extract.manifest`: the per-shard manifest (light: the UI reads it).

Only the manifest is exported here, so the API server can read shards without torch.
"""

from eagleflow.extract.manifest import ShardManifest

__all__ = ["ShardManifest"]
