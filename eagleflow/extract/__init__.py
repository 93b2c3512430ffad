"""The extraction stage: hidden states of each shard's rows, from a running engine, into the dataset.

- :mod:`~eagleflow.extract.shard`: one shard's rows, resumable (``python -m eagleflow extract``),
  with its flags in :mod:`~eagleflow.extract.config`;
- :mod:`~eagleflow.extract.client`: the engine's ``/generate`` and ``/abort_request`` as the extractor speaks them;
- :mod:`~eagleflow.extract.dump_wait`: waiting for a request's dump (late, lost, writer behind, disk full);
- :mod:`~eagleflow.extract.sample_store`: where a row's file lives, whether it is complete,
  and moving a server dump into place;
- :mod:`~eagleflow.extract.manifest`: the per-shard manifest (light: the UI reads it).

Only the manifest is exported here, so the API server can read shards without torch.
"""

from eagleflow.extract.manifest import ShardManifest

__all__ = ["ShardManifest"]
