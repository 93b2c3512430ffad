"""Online training (``hidden_states_source=engine``): the drafter learns from the live engines.

No shard is extracted. While speculators trains, each sample's hidden states are asked of the
run's engines shortly before the trainer needs them, checked exactly as extraction checks them,
handed to speculators and deleted, so the disk holds at most a budget whatever the dataset's size:

- :mod:`~eagleflow.train.online.settings`: what the step hands the trainer (light: no torch);
- :mod:`~eagleflow.train.online.feed`: :class:`SampleFeed`, the prefetcher in the trainer process
  (requests ahead of the trainer over several engines, a byte budget on disk, an optional cache
  for later epochs, a journal of its requests so a killed trainer leaves nothing behind);
- :mod:`~eagleflow.train.online.backend`: the seam into speculators, an hs-connectors
  ``HiddenStatesBackend`` whose transfer hands each sample over by file index.
"""
