"""The trigger form: each Param's schema (:func:`form_schemas`) and what it shows of its help: the form's labels,
not keys or flags; a long help as one short sentence and a link to the README's section about it.

A field's ``description`` is written once, for ``--help`` and the form alike (docs/design.md §2: one declaration
per knob), in the words of a command line: Param keys (``eval_configs``) and flags (``--draft-config``). The form
shows labels, so :func:`form_help` says each Param by its label (“Serving configs to sweep”), and a help longer than
:data:`SHORT_HELP` characters by its first sentence with a link to the README's section (served by the UI plugin at
:data:`README_PATH`, inside Airflow). A flag of another program (SGLang's ``--speculative-num-draft-tokens``,
SpecForge's ``--config-list``) stays as it is: that is the name a user looks for there.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagleflow.deploy import UI_PREFIX
from eagleflow.errors import UserError, excerpt_repr, param_text

SHORT_HELP = 240  # characters a help may have in the form before it is cut to its first sentence and a link
README_PATH = f"{UI_PREFIX}/readme"
# The README section each form section's help points to, and the Params with a section of their own.
SECTION_README = {
    None: "quickstart",
    "Engine": "running-on-a-gpu-node-with-sglang-and-kimi-k25",
    "Data": "input-formats-thinking-and-tool-calls-dataset_input-chat_template_kwargs",
    "Extraction": "checking-the-capture-before-extraction-verify-capture",
    "Training": "training-the-drafter-build-vocab-train",
    "Evaluation": "serving-and-measuring-the-drafter-export-evaluate",
    "Regeneration": "training-on-the-verifiers-own-answers-regenerate",
}
PARAM_README = {
    **dict.fromkeys(("draft_algorithm", "block_size", "mask_token_id", "max_anchors"), "drafter-families-eagle-3-or-dflash-draft_algorithm"),
    "drafters": "several-drafters-from-one-capture-compared-drafters",
    **dict.fromkeys(("hidden_states_source", "online_prefetch", "online_cache_gb"), "online-training-past-the-disk"),
    **dict.fromkeys(("sample_transport", "sample_store_conn_id", "dump_queue_gb"), "across-nodes-samples-through-a-mooncake-store-sample_transport"),
    **dict.fromkeys(("num_engines", "server_urls", "train_nodes"), "beyond-one-machine"),
}
# The form's one sentence for each help too long to read there (its whole text is --help's and the README's).
SHORT_HELPS = {
    "num_engines": "Engines this run launches, the shards spread over them; give the gpu pool as many slots.",
    "sample_transport": "How a captured sample reaches training: a file in a shared dump folder, or a Mooncake Store "
    "(no shared filesystem between engine and trainer nodes).",
    "sample_store_conn_id": "The Airflow connection of the Mooncake Store to use; empty: the run starts its own beside its "
    "first engine, on 127.0.0.1.",
    "dump_queue_gb": "Host memory an engine may hold in captured states not yet written; past it a request is sent "
    "again later, never waiting for the disk. Empty: 1/8 of its host's memory.",
    "drafters": "Several drafters trained from one capture and compared, e.g. [\"eagle3\", \"dflash\"]; each entry a "
    "family, or an object of its own settings. Empty: one drafter, the “Drafter family”.",
    "draft_algorithm": "The drafter family: eagle3 (a chain of one-token steps), eagle3.1, or dflash (one pass drafts a "
    "whole block).",
    "mask_token_id": "Block drafters: the token filling the draft block; empty: as SGLang resolves it from the "
    "verifier's tokenizer, else its pad token.",
    "train_nodes": "Nodes that train one drafter together (torchrun, data-parallel), each seeing the run folder at "
    "the same path.",
    "hidden_states_source": "disk: extract every shard, then train from the files; engine: no extraction, training asks "
    "the live engines for each sample (the disk holds a budget).",
    "eval_configs": "Serving configs to sweep, 'batch size,steps,topk,draft tokens' each (a block drafter: "
    "'batch size,1,1,block size'); empty: each drafter's own shape, one and “Requests in flight” at a time.",
    "redo_finished": "Make the vocabulary, export, evaluation and charts again even when their finished results were "
    "made from the same inputs.",
}
_FIRST_SENTENCE = re.compile(r"^(.+?(?<!e\.g)(?<!i\.e)\.)(?:\s|$)")


def readme_anchor(name: str, section: str | None) -> str:
    """The README section a Param's help links to: its own, else its form section's."""
    return PARAM_README.get(name) or SECTION_README[section]


def in_labels(text: str, labels: Mapping[str, str]) -> str:
    """``text`` with each Param key (one with an underscore: a plain word such as ``engine`` is also English) and each
    ``--flag`` that sets a Param said by the Param's form label."""

    def label(match: re.Match[str]) -> str:
        word = match.group(0)
        name = word[2:].replace("-", "_") if word.startswith("--") else word
        return f"“{labels[name]}”" if name in labels and ("_" in name or word.startswith("--")) else word

    return re.sub(r"(?<![\w\-\"'])(--[a-z][\w-]*|[a-z]+(?:_[a-z0-9]+)+)(?![\w\-\"'])", label, text)


def form_help(name: str, description: str, section: str | None, labels: Mapping[str, str], bounds: str = "") -> dict[str, Any]:
    """The schema keys that carry Param ``name``'s help in the form: ``description``, or for a long help
    ``description_md`` (Airflow's form renders it as Markdown when ``description`` is null) with the link.

    ``bounds``: a number's range as its help ends with it (``At least 1.``, :func:`eagleflow.config.bounds_text`),
    kept after a cut too: the form checks no bound itself, so the help is where a user reads it.
    """
    text = in_labels(description, {k: v for k, v in labels.items() if k != name})  # its own key: a symbol in a formula
    if len(text) <= SHORT_HELP:
        return {"description": text}
    room = SHORT_HELP - len(bounds) - 1 if bounds else SHORT_HELP
    match = _FIRST_SENTENCE.match(text)
    first = SHORT_HELPS.get(name) or (match.group(1) if match and len(match.group(1)) <= room else
                                      text[:room].rsplit(" ", 1)[0] + " …")
    if bounds and not first.endswith(bounds):
        first = f"{first} {bounds}"
    return {"description": None, "description_md": f"{first} [More in the README]({README_PATH}#{readme_anchor(name, section)})"}


def form_schemas() -> dict[str, dict[str, Any]]:
    """Each Param's JSON schema as the trigger form takes it (:func:`eagleflow.run.pipeline.param_schemas`), its help
    in the form's words (:func:`form_help`)."""
    from eagleflow.run.pipeline import param_schemas

    from eagleflow.config import bounds_text

    schemas = param_schemas()
    labels = {name: schema.get("title") or name for name, schema in schemas.items()}
    for name, schema in schemas.items():
        if schema.get("description"):
            bounds = bounds_text(schema["allOf"][0]) if schema.get("allOf") else ""
            schema.update(form_help(name, schema["description"], schema.get("section"), labels, bounds))
    return schemas


def read_form_defaults(path: str | Path, schemas: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A deployment's defaults for the trigger form: the JSON object ``{Param: value}`` in ``path`` (the file
    ``EAGLEFLOW_FORM_DEFAULTS`` names), each value checked by its Param's schema in ``schemas`` as Airflow checks a
    trigger's. Raises :class:`UserError` naming the file and the key (not a Param, or a value its schema refuses)."""
    import jsonschema

    try:
        text = Path(path).read_text()
        defaults = json.loads(text) if text.strip() else None
    except (OSError, ValueError) as exc:
        raise UserError(f"form defaults {path}: cannot be read as JSON ({exc})") from None
    if not isinstance(defaults, dict):
        got = "an empty file" if defaults is None else type(defaults).__name__
        raise UserError(f"form defaults {path}: expected an object of Param values, got {got}")
    for name in sorted(set(defaults) - set(schemas)):
        close = difflib.get_close_matches(name, list(schemas), n=1)
        raise UserError(f"form defaults {path}: {name!r} is not a Param of the DAG" + (f" (did you mean {close[0]!r}?)" if close else ""))
    for name, value in defaults.items():
        try:
            schema = {k: v for k, v in schemas[name].items() if k != "default" and v is not None}  # a cut help's null description
            jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as exc:
            raise UserError(f"form defaults {path}: {param_text(name, schemas[name].get('title'))} refuses "
                            f"{excerpt_repr(value)}: {exc.message}") from None
    return defaults
