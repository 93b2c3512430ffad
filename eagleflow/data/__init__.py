"""The data stage: what happens to the rows before and beside extraction.

- :mod:`~eagleflow.data.prepare`: conversations or token ids -> the training dataset (§3.3);
- :mod:`~eagleflow.data.stats` and :mod:`~eagleflow.data.disk_check`: how big the hidden
  states will be, and whether the disk holds them;
- :mod:`~eagleflow.data.vocab`: the draft vocabulary (d2t/t2d);
- :mod:`~eagleflow.data.verifier`: facts about the verifier read from its ``config.json``,
  and the aux layer ids a run captures.
"""

from eagleflow.data.verifier import config_int, resolve_aux_layer_ids, text_config

__all__ = ["config_int", "resolve_aux_layer_ids", "text_config"]
