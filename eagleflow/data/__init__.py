"""The data stage: what happens to the rows before and beside extraction.

- :mod:`~eagleflow.data.prepare`: conversations or token ids -> the training dataset (§3.3);
- :mod:`~eagleflow.data.conversation`: what an input row is (OpenAI messages with thinking and tool calls,
  ShareGPT, token ids; JSONL, Parquet, a datasets folder), and :mod:`~eagleflow.data.chat_tokens`: a
  conversation's training rows under the verifier's chat template and its switches;
- :mod:`~eagleflow.data.stats` and :mod:`~eagleflow.data.disk_check`: how big the hidden
  states will be, and whether the disk holds them;
- :mod:`~eagleflow.data.vocab`: the draft vocabulary (d2t/t2d).

What the verifier is (its config, tokenizer and weights) is :mod:`eagleflow.verifier`'s.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "dataset_files": ["dataset_column", "dataset_fingerprint", "dataset_shape", "dataset_state", "dataset_table"],
        "prepare": ["MARKER_FILE", "PrepareConfig"],
        "conversation": ["Chat", "chat_of", "is_chat_row", "read_input_rows"],
        "chat_tokens": ["ChatTokenizer", "TemplateCannotRender", "check_chat_template_kwargs", "render_ids", "rows_of_turns"],
        "vocab": ["VocabConfig", "VocabFiles", "build_vocab", "load_mappings"],
        "regenerate": ["CONVERSATIONS_FILE", "RegenerateConfig", "SKIPPED_FILE", "SUMMARY_FILE"],
        "disk_check": ["DiskCheckConfig"],
        "stats": ["StatsConfig"],
    },
)
