"""The knobs of one pipeline run (the DAG's Params form), declared once.

``PipelineConfig`` is what a user sets when triggering a run; each Airflow operator builds it
from the run's params (:meth:`PipelineConfig.from_params`) and turns it into the argv of its
step. :func:`param_schemas` gives the JSON schema of every field, which the DAG turns into
Airflow ``Param`` objects, so a knob's default, type, title and description live here only.
A Param that sets a step's flag is that flag: its type, default, title and description are the
field of the step's own config, and a field with a title is offered in the form
(:mod:`eagleflow.run.step_params`), so offering another existing flag is one edit, its label. Each
``PipelineConfig.<step>_config()`` gives a step its typed config (its Params as given, plus the
run's folders and engines), and every operator turns that into the step's argv with
:func:`eagleflow.config.model_to_argv`.

Airflow validates a triggered run's conf against those JSON schemas before the run is created, so what
a schema can say (types, bounds, distinct aux ids) is refused at trigger time; the drafter family's rules
and what needs the model folder are checked in the first task (:meth:`PipelineConfig.check_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from eagleflow.config import AuxLayerIds, EngineKind, SampleStoreConnId, SampleTransport, StoredHiddenStatesDtype, TpSize, WarmupTimeout
from eagleflow.config import build_model, schemas_of
from eagleflow.engine import ServerInfo
from eagleflow.data import DiskCheckConfig
from eagleflow.data import PrepareConfig
from eagleflow.data import CONVERSATIONS_FILE, RegenerateConfig
from eagleflow.data import StatsConfig
from eagleflow.data import VocabConfig
from eagleflow.run.drafters import RunDrafters
from eagleflow.evaluate import EvaluateConfig
from eagleflow.extract import ExtractConfig
from eagleflow.extract import VerifyCaptureConfig
from eagleflow.errors import UserError, excerpt_repr
from eagleflow.layout import RUN_NAME_PATTERN, RunLayout, check_output_path, check_run_name, run_name_from_run_id
from eagleflow.run.step_params import FORM_SECTIONS, STEP_PARAM_GROUPS, STEP_PARAMS, StepParams, param_feeds
from eagleflow.train import TrainConfig

if TYPE_CHECKING:  # imported where used: the DAG file imports this module, and these pull in the heavier steps
    from eagleflow.report import CompareConfig
    from eagleflow.export import ExportConfig
    from eagleflow.metrics import PlotConfig

M = TypeVar("M", bound=BaseModel)


class PipelineConfig(RunDrafters):
    """Every Param of the eagleflow DAG (the drafters Param: :class:`~eagleflow.run.drafters.RunDrafters`)."""

    engine: EngineKind = Field(title="Engine")
    model_path: str = Field(
        title="Verifier model folder",
        description="Local folder of the base model (config.json, safetensors, tokenizer), e.g. Kimi-K2.5.",
    )
    dataset_input: str = Field(
        title="Dataset input",
        description="JSONL or Parquet: chat rows ({'messages': [...]}) or token ids ({'input_ids': [...], 'loss_mask': [...]}).",
    )
    output_root: str = Field(
        title="Output root", description="Folder that holds one sub-folder per run (dataset, shards, server log, training, charts)."
    )
    run_name: str | None = Field(
        None,
        json_schema_extra={"pattern": RUN_NAME_PATTERN},  # Airflow's form refuses a bad name before the run exists
        title="Run name",
        description="Sub-folder of the output root. Reusing a name resumes that run's work; empty: derived from the DAG run id.",
    )
    regenerate_responses: bool = Field(
        False,
        title="Regenerate responses",
        description="Rewrite the dataset's assistant turns with the verifier through the warm engine before "
        "preparation, so the drafter learns the verifier's own answers (regen_* Params).",
        json_schema_extra={"section": "Regeneration"},
    )
    aux_layer_ids: AuxLayerIds | None = Field(
        None,
        title="Aux layer ids",
        description="Layer ids whose input state is captured (state entering layer k); the final pre-norm state is "
        "added. Distinct, 0..n for an n-layer verifier. Empty: speculators' default [2, n//2, n-3]. "
        "The seed's Kimi-K2.5 run used [3, 31, 59].",
        json_schema_extra={"section": "Extraction"},
    )
    hidden_states_dtype: StoredHiddenStatesDtype = Field(title="Hidden-state storage", json_schema_extra={"section": "Extraction"})
    shard_size: int = Field(2000, ge=1, title="Shard size", description="Rows per extraction shard (one mapped task each).", json_schema_extra={"section": "Extraction"})
    stop_after_extraction: bool = Field(
        False,
        title="Stop after extraction",
        description="Extract the hidden states and stop: no vocabulary, training, export or evaluation. A later run "
        "with the same run name and this off trains from them without extracting a row again.",
        json_schema_extra={"section": "Extraction"},
    )
    dump_queue_gb: float | None = Field(
        None,
        gt=0,
        title="Dump queue budget (GB)",
        description="Host memory the engine may hold in captured, not yet written hidden states (pinned on a GPU). "
        "When the disk falls this far behind, a request gets 'writer behind' and the extractor sends it again later, "
        "instead of the forward pass waiting for the disk. Empty: 1/8 of the engine host's memory, at most 32 GiB.",
        json_schema_extra={"section": "Extraction"},
    )
    server_port: int = Field(
        30000, ge=0, le=65535, title="Server port", description="Port of the launched engine; 0 picks a free port.",
        json_schema_extra={"section": "Engine"},
    )
    tp_size: TpSize = Field(title="Tensor parallel size", json_schema_extra={"section": "Engine"})
    server_extra_args: list[str] = Field(
        default_factory=list,
        title="Extra capture engine arguments",
        description="Appended to the command line of each engine this run launches for capture, as separate arguments "
        "(never through a shell); the evaluation's engines take eval_server_extra_args.",
        json_schema_extra={"section": "Engine"},
    )
    warmup_timeout: WarmupTimeout = Field(title="Warmup timeout (s)", json_schema_extra={"section": "Engine"})
    num_engines: int = Field(
        1,
        ge=1,
        le=64,
        title="Engines to launch",
        description="Engines this run launches, each by its own launch_server task on the GPU queue (ports "
        "server_port, server_port+1, …); shards are spread over them and an engine that dies fails only its "
        "shards, whose retries go to one that is up. Give the gpu pool as many slots. Ignored with server_urls.",
        json_schema_extra={"section": "Engine"},
    )
    server_urls: list[str] = Field(
        default_factory=list,
        title="Remote engine URLs",
        description="Use engines that are already running, e.g. one per GPU node (http://gpu-node-1:30000, …): "
        "launch and stop do nothing, the readiness wait polls each, shards are spread over them.",
        json_schema_extra={"section": "Engine"},
    )
    server_dump_dir: str | None = Field(
        None,
        title="Remote engines' dump folder",
        description="With remote engines: the one folder their capture hooks write to, as seen from the workers.",
        json_schema_extra={"section": "Engine"},
    )
    sample_transport: SampleTransport
    sample_store_conn_id: SampleStoreConnId

    # Not a Param itself: the steps' Params as given (checked by from_params); see train_config(),
    # evaluate_config().
    step_params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("run_name")
    @classmethod
    def _plain_run_name(cls, run_name: str | None) -> str | None:
        return None if run_name is None else check_run_name(run_name)

    @field_validator("server_urls")
    @classmethod
    def _engine_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ValueError(f"{excerpt_repr(url)} is not an engine URL like http://gpu-node-1:30000")
        if len(set(urls)) != len(urls):
            raise ValueError(f"engines listed twice: {sorted({u for u in urls if urls.count(u) > 1})}")
        return [url.rstrip("/") for url in urls]

    @field_validator("output_root", "server_dump_dir")
    @classmethod
    def _where_runs_may_write(cls, value: str | None) -> str | None:
        import os

        from eagleflow.deploy import OUTPUT_ROOT_ENV

        return None if value is None else check_output_path(value, os.environ.get(OUTPUT_ROOT_ENV))

    @model_validator(mode="after")
    def _online_extracts_nothing(self) -> PipelineConfig:
        if self.stop_after_extraction and self.step_params.get("hidden_states_source") == "engine":
            raise ValueError("stop_after_extraction with hidden_states_source engine: online training extracts nothing to stop after")
        return self

    @model_validator(mode="after")
    def _remote_needs_dump_dir(self) -> PipelineConfig:
        if self.server_urls and self.sample_transport == "mooncake" and not self.sample_store_conn_id:
            raise ValueError("sample_transport mooncake with server_urls needs sample_store_conn_id (the store the remote hooks use)")
        if self.server_urls and not self.server_dump_dir and self.sample_transport == "file":
            raise ValueError("server_dump_dir is required with server_urls (where the remote hooks write their dumps)")
        return self

    @field_validator("server_extra_args")
    @classmethod
    def _extra_args_policy(cls, extra: list[str], info: ValidationInfo) -> list[str]:
        from eagleflow.engine import check_server_extra_args

        try:
            check_server_extra_args(info.data.get("engine", "reference"), extra)
        except UserError as exc:
            raise ValueError(str(exc)) from exc
        return extra

    @classmethod
    def from_params(cls, params: dict[str, Any], run_id: str = "") -> PipelineConfig:
        """Build from a DAG run's params; a bad value raises :class:`UserError` naming the Param.

        Reads nothing from disk (the teardown needs it even when the model folder is wrong);
        :meth:`check_model` is the check against the model.
        """
        params = dict(params)
        # A Param left empty in the form (null) takes its default.
        values = {k: v for k, v in params.items() if k in PIPELINE_PARAMS and not (v is None and not cls.model_fields[k].is_required())}
        for name in ("run_name", "server_dump_dir", "aux_layer_ids"):
            if values.get(name) in ("", []):
                values[name] = None
        values["step_params"] = {k: params[k] for k in STEP_PARAMS if params.get(k) is not None}
        build_model(StepParams, values["step_params"], param_name)
        cfg = build_model(cls, values, param_name)
        if cfg.run_name is None:
            cfg = cfg.model_copy(update={"run_name": run_name_from_run_id(run_id)})
        # What the evaluation's own checks refuse (eval_configs by the family's rules, first: its message names the
        # rule; eval_server_extra_args against the engine; a prompt file without its set) fails the first task, not the last.
        cfg.check_drafters()
        return cfg

    @property
    def dump_queue_bytes(self) -> int | None:
        """The ``dump_queue_gb`` Param in bytes (None: the engine sizes it from its host's memory)."""
        return None if self.dump_queue_gb is None else int(self.dump_queue_gb * 1e9)

    @property
    def remote(self) -> bool:
        """Remote mode: the engines run elsewhere; the run launches and stops none."""
        return bool(self.server_urls)

    def engine_plan(self) -> list[dict[str, Any]]:
        """The run's engines, ``[{name, index, url, port}]`` (:func:`eagleflow.engine.pool.plan_engines`)."""
        from eagleflow.engine import plan_engines

        return plan_engines(self.num_engines, self.server_urls, self.server_port)

    @property
    def layout(self) -> RunLayout:
        """The run's folders (a drafter's own, seen from one of several drafters)."""
        return RunLayout.of(self.output_root, self.run_name or "run").for_drafter(self.drafter_name)

    def check_model(self) -> PipelineConfig:
        """Check what needs the model folder (a model folder, every drafter's aux ids fit its depth); returns self.
        The other path Params are the first task's to check (:func:`eagleflow.run.param_checks.check_paths`): a later
        task (a retry, a clear) does not read the dataset's input again."""
        from eagleflow.run.param_checks import check_model_folder

        check_model_folder(self)
        self.captured_aux_layer_ids()
        return self

    def step_values(self, model: type[BaseModel]) -> dict[str, Any]:
        """The Params given (a drafter's own over the run's) that set flags of the step whose config is ``model``."""
        return {name: value for name, value in self.given_step_params().items() if param_feeds(name, model)}

    def step_config(self, model: type[M], **run_values: Any) -> M:
        """``model`` from the step's Params as given plus ``run_values`` (this run's folders, engine, aux ids);
        a bad value raises :class:`UserError` naming its Param."""
        return build_model(model, {**self.step_values(model), **run_values}, param_name)

    @property
    def prepare_input(self) -> str:
        """What preparation tokenises: the regenerated conversations when regeneration is on."""
        return str(self.layout.regenerated / CONVERSATIONS_FILE) if self.regenerate_responses else self.dataset_input

    def prepare_config(self) -> PrepareConfig:
        """``prepare-dataset``: the input (or its regenerated answers) into the run's dataset."""
        return self.step_config(PrepareConfig, input=self.prepare_input, verifier=model_dir(self), out=self.layout.dataset)

    def regenerate_config(self, server_url: str, server_pid: int | None) -> RegenerateConfig:
        """``regenerate``: the input's answers rewritten through the engine at ``server_url``."""
        return self.step_config(
            RegenerateConfig, input=self.dataset_input, verifier=model_dir(self), out=self.layout.regenerated,
            server=server_url, server_pid=server_pid, warmup_timeout=self.warmup_timeout,
        )

    def stats_config(self) -> StatsConfig:
        """``dataset-stats``: the prepared dataset's rows, tokens and hidden-state bytes."""
        return self.step_config(
            StatsConfig, dataset=self.layout.dataset, verifier=model_dir(self), aux_layer_ids=self.captured_aux_layer_ids(),
            hidden_states_dtype=self.hidden_states_dtype,
        )

    def disk_check_config(self, folder: Path, needed_bytes: int) -> DiskCheckConfig:
        """``check-disk``: ``folder`` must hold ``needed_bytes`` with the margin."""
        return self.step_config(DiskCheckConfig, folder=folder, needed_bytes=needed_bytes)

    def verify_capture_config(self, server: ServerInfo) -> VerifyCaptureConfig:
        """The capture check's config: its Params plus this run's dataset, verifier and aux ids, for engine ``server``."""
        return self.step_config(
            VerifyCaptureConfig, dataset=self.layout.dataset, server=server.url, dump_dir=server.dump_dir,
            sample_store=server.store_json(), verifier=model_dir(self),
            aux_layer_ids=self.captured_aux_layer_ids(), hidden_states_dtype=self.hidden_states_dtype,
            out=self.layout.capture_check(server.name),
        )

    def extract_config(self, server: ServerInfo, shard: dict[str, Any]) -> ExtractConfig:
        """``extract``: the rows of ``shard`` (``{name, start, end}``) from ``server``, watched by pid when it runs here."""
        return self.step_config(
            ExtractConfig, dataset=self.layout.dataset, server=server.url, engine_name=server.name, dump_dir=server.dump_dir,
            sample_store=server.store_json(),
            rows=f"{int(shard['start'])}:{int(shard['end'])}", verifier=model_dir(self),
            aux_layer_ids=self.captured_aux_layer_ids(), hidden_states_dtype=self.hidden_states_dtype,
            manifest=self.layout.shard_manifest(str(shard["name"])), server_pid=server.pid if server.is_local else None,
        )

    def vocab_config(self) -> VocabConfig:
        """``build-vocab``: the draft vocabulary in the run's dataset."""
        return self.step_config(VocabConfig, dataset=self.layout.dataset, verifier=model_dir(self))

    def train_config(self, engines: list[ServerInfo] | None = None, node_rank: int = 0) -> TrainConfig:
        """The training step's config: the training Params plus this run's folders and aux ids.

        :param engines: online (``hidden_states_source`` engine), the engines training asks.
        :param node_rank: which of the training nodes runs it.
        """
        values: dict[str, Any] = {
            "dataset": self.layout.dataset,
            "verifier": model_dir(self),
            "out": self.layout.train.root,
            "aux_layer_ids": self.resolved_aux_layer_ids(),
            "captured_aux_layer_ids": self.captured_aux_layer_ids(),
            "hidden_states_dtype": self.hidden_states_dtype,
            # What the engines' writers may hold, online training may hold ahead of the trainer.
            "online_window_gb": self.dump_queue_gb,
            "node_rank": node_rank,
        }
        if engines:  # one hand-off folder for all of a run's engines
            values.update(engine_urls=[e.url for e in engines], engine_names=[e.name for e in engines],
                          dump_dir=Path(engines[0].dump_dir), sample_store=engines[0].store_json())
            plan = self.drafter_plan()
            if len(plan) > 1:  # several drafters: one prefill per sample for all (eagleflow.train.online.share)
                values["online_trainers"] = [self.for_drafter(d).layout.train.root for d in plan]
        return self.step_config(TrainConfig, **values)

    @property
    def online(self) -> bool:
        """Online training: no shard is extracted; the engines stay up through training."""
        return self.step_param("hidden_states_source") == "engine"

    def step_param(self, name: str) -> Any:
        """Step Param ``name`` as given (a drafter's own first), else its step's default."""
        return self.given_step_params().get(name, STEP_PARAMS[name].model_fields[name].get_default(call_default_factory=True))

    def plot_config(self) -> PlotConfig:
        """``plot``: charts of the run's training metrics (a :class:`~eagleflow.metrics.plot.PlotConfig`)."""
        from eagleflow.metrics import PlotConfig

        return self.step_config(PlotConfig, metrics=self.layout.train.metrics, out=self.layout.charts)

    def export_config(self) -> ExportConfig:
        """``export``: the best checkpoint as the drafter folders (an :class:`~eagleflow.export.step.ExportConfig`)."""
        from eagleflow.export import ExportConfig

        return self.step_config(ExportConfig, train_dir=self.layout.train.root, verifier=model_dir(self), out=self.layout.drafter)

    def evaluate_config(self) -> EvaluateConfig:
        """The evaluation step's config: its Params plus this run's folders, engine and training split."""
        layout = self.layout
        return self.step_config(
            EvaluateConfig, dataset=layout.dataset, verifier=model_dir(self), drafter=layout.drafter, out=layout.evaluation,
            train_dir=layout.train.root, engine=self.engine, tp_size=self.tp_size, warmup_timeout=self.warmup_timeout,
        )

    def compare_config(self, drafters: list[dict[str, Any]]) -> CompareConfig:
        """``compare``: ``drafters`` (entries of :meth:`drafter_plan`) side by side in the run's ``eval/compare.json``."""
        from eagleflow.report import CompareConfig

        return CompareConfig(run=self.layout.root, drafters=[d["folder"] for d in drafters if d.get("folder")])


PIPELINE_PARAMS = tuple(name for name in PipelineConfig.model_fields if name not in ("step_params", "drafter_name", "drafter_settings"))


def param_name(field: str) -> str:
    """How a run's user knows a setting: its name and its label in the form, ``Param epochs ("Epochs")``."""
    from eagleflow.errors import param_text

    owner = STEP_PARAMS.get(field) or (PipelineConfig if field in PipelineConfig.model_fields else None)
    return param_text(field, owner.model_fields[field].title if owner is not None else None)


def param_schemas() -> dict[str, dict[str, Any]]:
    """JSON schema of each Param (``default``, ``type``, ``title``, ``description``, ``section``, bounds), in form order.

    Airflow's trigger form opens only its first section ("Run Parameters": the Params without a
    section, what every run sets); the others start collapsed. A step's Params are its step's
    section; the pipeline's own name theirs with ``json_schema_extra={"section": …}``.
    """
    schemas = schemas_of(PipelineConfig, PIPELINE_PARAMS)
    for model, names, section in STEP_PARAM_GROUPS:
        schemas.update(schemas_of(model, names, section=section))
    order = {section: rank for rank, section in enumerate(FORM_SECTIONS)}
    return dict(sorted(schemas.items(), key=lambda item: order[item[1].get("section")]))  # stable: field order within a section


def model_dir(cfg: PipelineConfig) -> Path:
    """The verifier folder as an absolute path (checkpoints record it as typed, docs/design.md §8)."""
    return Path(cfg.model_path).absolute()
