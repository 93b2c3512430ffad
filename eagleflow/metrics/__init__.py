"""The metrics stage: training metrics read in any form, and the charts drawn from them.

- :mod:`~eagleflow.metrics.records`: what one ``metrics.jsonl`` record is, and its line reader;
- :mod:`~eagleflow.metrics.reader`: any metrics file -> one DataFrame, and the latest numbers;
- :mod:`~eagleflow.metrics.text_forms`: speculators' Rich and raw-repr log output -> records;
- :mod:`~eagleflow.metrics.plot`: loss and accuracy charts (``python -m eagleflow plot``); a block
  drafter's, with its expected accept length, by :mod:`~eagleflow.metrics.block_plot`.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "reader": ["latest_metrics", "read_metrics", "ttt_steps", "parse_metrics"],
        "records": ["block_positions_of", "format_record", "is_block", "read_records", "train_record", "val_record"],
        "plot": ["PlotConfig"],
    },
)
