"""The trigger form's help speaks the form's language: labels, not Param keys or our flags; a long help is one
sentence and a link to the README's section, which the plugin serves with GitHub's anchors."""

from __future__ import annotations

import re
from typing import Any

from eagleflow.run import form_schemas
from eagleflow.run.form import SHORT_HELP
from eagleflow.run.pipeline import param_schemas

LINK = re.compile(r"\[More in the README\]\(/eagleflow/readme#([\w-]+)\)$")


def shown(schema: dict[str, Any]) -> str:
    """What the form shows under a field: ``description``, else ``description_md`` (Airflow 3.3's FieldRow)."""
    return schema["description"] if schema.get("description") is not None else schema.get("description_md") or ""


def test_the_form_says_params_by_their_labels_and_cuts_long_help_to_a_sentence_and_a_link() -> None:
    schemas = form_schemas()
    for name, schema in schemas.items():
        text = LINK.sub("", shown(schema))
        keys = [w for w in re.findall(r"(?<![\w\"'\[-])[a-z]+(?:_[a-z0-9]+)+", text) if w in schemas and w != name]
        flags = [w for w in re.findall(r"--[a-z][\w-]*", text) if w[2:].replace("-", "_") in schemas and w[2:].replace("-", "_") != name]
        assert (keys, flags) == ([], []), name
        assert len(text) <= SHORT_HELP, name
    drafters = shown(schemas["drafters"])
    assert "“Drafter family”" in drafters and LINK.search(drafters)
    assert "draft_algorithm" in param_schemas()["drafters"]["description"], "--help keeps the whole text"
    assert "“Serving configs to sweep”" in shown(schemas["eval_concurrency"])


def test_every_link_of_the_form_opens_its_readme_section(client: Any) -> None:
    page = client.get("/readme")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    anchors = set(re.findall(r'<h[1-6] id="([^"]+)"', page.text))
    linked = {match.group(1) for schema in form_schemas().values() if (match := LINK.search(shown(schema)))}
    assert linked and linked <= anchors, sorted(linked - anchors)


def test_a_bounded_number_says_its_range_in_the_form_even_when_its_help_is_cut() -> None:
    """The form checks no bound itself (a refused value is named only in the box at the form's top): the help under
    the field says the range, also after a long help is cut to its first sentence."""
    from eagleflow.config import bounds_text

    bounded = {name: schema for name, schema in form_schemas().items() if schema.get("allOf")}
    for name, schema in bounded.items():
        assert LINK.sub("", shown(schema)).rstrip().endswith(bounds_text(schema["allOf"][0])), name
    assert shown(bounded["shard_size"]).endswith("At least 1.") and bounded["shard_size"]["allOf"] == [{"minimum": 1}]
    assert LINK.search(shown(bounded["num_engines"])) and "From 1 to 64. [More in the README]" in shown(bounded["num_engines"])


def test_a_deployments_defaults_file_fills_the_form_and_a_bad_one_is_refused_naming_it(tmp_path: Any, monkeypatch: Any) -> None:
    """``EAGLEFLOW_FORM_DEFAULTS`` names a JSON object of Param values, put over the deployment's other defaults."""
    import json

    import pytest

    from eagleflow.errors import UserError
    from operators.params import FORM_DEFAULTS_ENV, form_defaults, pipeline_params

    monkeypatch.delenv("EAGLEFLOW_DEMO_DIR", raising=False)
    monkeypatch.setenv("EAGLEFLOW_OUTPUT_ROOT", str(tmp_path / "runs"))
    defaults = tmp_path / "form-defaults.json"
    defaults.write_text(json.dumps({"model_path": "/models/kimi", "shard_size": 500, "drafters": ["eagle3", "dflash"]}))
    monkeypatch.setenv(FORM_DEFAULTS_ENV, str(defaults))
    form = pipeline_params(form_defaults())
    assert (form["model_path"]["default"], form["shard_size"]["default"], form["drafters"]["default"]) == (
        "/models/kimi", 500, ["eagle3", "dflash"])
    assert form["output_root"]["default"] == str(tmp_path / "runs")  # the deployment's, not overwritten

    for text, said in (('{"shard_sise": 500}', "'shard_sise' is not a Param of the DAG (did you mean 'shard_size'?)"),
                       ('["eagle3"]', "expected an object of Param values, got list"), ("", "got an empty file"),
                       ("{", "cannot be read as JSON"),
                       ('{"shard_size": 0}', 'Param shard_size ("Shard size") refuses 0: 0 is less than the minimum of 1')):
        defaults.write_text(text)
        with pytest.raises(UserError, match=re.escape(said)) as refused:
            form_defaults()
        assert str(defaults) in str(refused.value)
