"""The part of a run's Params that says which drafters it trains: :class:`RunDrafters`, a base of
:class:`~eagleflow.run.pipeline.PipelineConfig`.

A run's config seen from one of its drafters (:meth:`RunDrafters.for_drafter`) is the run's
config with that drafter's own settings over the run's step Params, its own aux layer ids, and
its own folders (:meth:`eagleflow.layout.RunLayout.for_drafter`); the capture is the union of
every drafter's layers (:meth:`RunDrafters.captured_aux_layer_ids`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from eagleflow.config import AuxLayerIds
from eagleflow.drafters import DRAFTER_SETTINGS, drafter_plan, union_of_layers
from eagleflow.errors import UserError

if TYPE_CHECKING:
    from eagleflow.drafters import DrafterFamily


class RunDrafters(BaseModel):
    """The ``drafters`` Param and, for a config seen from one drafter, which one (not Params)."""

    drafters: list[str | dict[str, Any]] = Field(
        default_factory=list,
        title="Drafters to compare",
        description="Train several drafters from one capture and measure them side by side, e.g. "
        "[\"eagle3\", {\"name\": \"dflash-b8\", \"draft_algorithm\": \"dflash\", \"block_size\": 8}]. An entry is a "
        f"family name or an object of its own settings ({', '.join(DRAFTER_SETTINGS)}; the rest are the run's). "
        "Empty: one drafter, draft_algorithm with the run's settings.",
        json_schema_extra={"section": "Training", "items": {"type": ["string", "object"]}},
    )
    # Not Params: which drafter this config is seen from (None: the run as a whole, or its one drafter).
    drafter_name: str | None = None
    drafter_settings: dict[str, Any] = Field(default_factory=dict)

    # Declared by PipelineConfig; here for the type checker.
    if TYPE_CHECKING:
        step_params: dict[str, Any]
        aux_layer_ids: AuxLayerIds | None
        model_path: str

        def step_param(self, name: str) -> Any: ...
        def evaluate_config(self) -> Any: ...

    def drafter_plan(self) -> list[dict[str, Any]]:
        """The run's drafters, ``[{name, folder, settings}]`` (:func:`eagleflow.drafters.plan.drafter_plan`)."""
        try:
            return drafter_plan(self.drafters, self.run_step_param("draft_algorithm"))
        except ValueError as exc:
            raise UserError(str(exc)) from exc

    def run_step_param(self, name: str) -> Any:
        """Step Param ``name`` as the run gives it, whichever drafter this config is seen from."""
        return self.model_copy(update={"drafter_settings": {}}).step_param(name)

    def for_drafter(self, drafter: dict[str, Any]) -> Any:
        """This run's config seen from ``drafter`` (an entry of :meth:`drafter_plan`)."""
        return self.model_copy(update={"drafter_name": drafter.get("folder"), "drafter_settings": dict(drafter.get("settings") or {})})

    def given_step_params(self) -> dict[str, Any]:
        """The step Params as given to the run, with this drafter's own settings over them.

        A drafter of another family than the run's ``draft_algorithm`` (by speculators' type: eagle3 and eagle3.1
        are one) takes its own family's defaults for the settings whose meaning is a family's
        (:data:`~eagleflow.drafters.plan.FAMILY_SHAPED`: a block drafter beside EAGLE-3 ones reads the full
        vocabulary and sweeps its own block, not their reduced vocabulary and chains), unless it sets them.
        """
        from eagleflow.drafters import FAMILY_SHAPED, family

        own = {k: v for k, v in self.drafter_settings.items() if k != "aux_layer_ids"}
        given = {**self.step_params, **own}
        if self.drafter_name is not None and "draft_algorithm" in own:
            run_family = family(self.run_step_param("draft_algorithm"))
            if family(own["draft_algorithm"]).speculator_type != run_family.speculator_type:
                for name in FAMILY_SHAPED:
                    if name not in own:
                        given.pop(name, None)
        return given

    @property
    def given_aux_layer_ids(self) -> list[int] | None:
        """This drafter's aux layer ids as given (its own, else the run's)."""
        return self.drafter_settings.get("aux_layer_ids", self.aux_layer_ids) or None

    def resolved_aux_layer_ids(self) -> list[int]:
        """This drafter's aux ids: given, or speculators' default for the verifier's depth, checked against it."""
        from eagleflow.verifier import resolve_aux_layer_ids
        from eagleflow.errors import param_text

        # Name the Param the ids came from: the drafter's own setting, else the run's.
        name = (f"Param drafters ({self.drafter_name}) aux_layer_ids" if "aux_layer_ids" in self.drafter_settings
                else param_text("aux_layer_ids", type(self).model_fields["aux_layer_ids"].title))
        return resolve_aux_layer_ids(self.model_path, self.given_aux_layer_ids, name=name)

    def captured_aux_layer_ids(self) -> list[int]:
        """What the engines capture: the union of every drafter's aux ids (a run's one drafter: its own)."""
        return union_of_layers([self.for_drafter(d).resolved_aux_layer_ids() for d in self.drafter_plan()])

    def drafter_family(self) -> DrafterFamily:
        """The drafter family this config trains (Param draft_algorithm, or the drafter's own; :mod:`eagleflow.drafters`)."""
        from eagleflow.drafters import family

        return family(self.step_param("draft_algorithm"))

    def check_drafter_family(self) -> None:
        """The drafter family's rules on the Params that depend on it (block size, draft vocabulary, its own settings, serving configs)."""
        from eagleflow.drafters import FAMILY_SETTINGS, check_family_settings
        from eagleflow.evaluate import check_configs_param
        from eagleflow.train import TrainConfig

        vocab = self.step_param("draft_vocab_size")
        prefix = "Param " if self.drafter_name is None else f"Param drafters ({self.drafter_name}): "
        try:
            chosen = check_family_settings(self.step_param("draft_algorithm"), self.step_param("block_size"),
                                           None if vocab == TrainConfig.model_fields["draft_vocab_size"].default else vocab,
                                           **{name: self.step_param(name) for name in FAMILY_SETTINGS})
        except ValueError as exc:
            raise UserError(f"{prefix}{exc}") from exc
        check_configs_param(self.step_param("eval_configs"), chosen.name, chosen.block)

    def check_drafters(self) -> None:
        """Each drafter's settings by its family's and its steps' own rules, before any work (a bad one named)."""
        from eagleflow.config import build_model
        from eagleflow.drafters import family
        from eagleflow.run.step_params import StepParams

        plan = self.drafter_plan()
        for drafter in plan:
            try:
                family(drafter["settings"].get("draft_algorithm") or self.run_step_param("draft_algorithm"))
            except ValueError as exc:  # an unknown family, or one not offered (its reason)
                raise UserError(f"{self.drafter_label(drafter)} draft_algorithm: {exc}") from None
        epochs = {d["name"]: self.for_drafter(d).step_param("epochs") for d in plan}
        if len(set(epochs.values())) > 1 and self.run_step_param("hidden_states_source") == "engine":
            # Online, every drafter reads each sample of one prefill, pass after pass: they train as many passes.
            raise UserError(
                f"Param drafters: online (hidden_states_source engine) every drafter trains the same number of epochs, "
                f"as they share each sample: {', '.join(f'{n} {e}' for n, e in epochs.items())}"
            )
        for drafter in plan:
            seen = self.for_drafter(drafter)
            label = drafter["name"]
            build_model(StepParams, seen.given_step_params(), lambda field: f"Param drafters ({label}) {field}")
            seen.check_drafter_family()
            seen.evaluate_config()

    def drafter_label(self, drafter: dict[str, Any]) -> str:
        """How a message names ``drafter``'s settings: ``Param drafters (name)``, or the run's Params for its one drafter."""
        return "Param" if drafter.get("folder") is None else f"Param drafters ({drafter['name']})"

    def check_drafters_against_verifier(self) -> None:
        """What SGLang would refuse of each drafter's settings for this verifier (its family's ``check``: context
        layers it cannot capture, a mask token it cannot embed), before any engine starts; a refusal names the drafter."""
        from pathlib import Path

        for drafter in self.drafter_plan():
            seen = self.for_drafter(drafter)
            chosen = seen.drafter_family()
            settings = {name: seen.step_param(name) for name in ("mask_token_id", "block_size", "serve_with")}
            try:
                chosen.owner("check")(Path(self.model_path), seen.resolved_aux_layer_ids(), settings)
            except ValueError as exc:  # the family's rule, in its words
                raise UserError(f"{self.drafter_label(drafter)} ({chosen.name} for {self.model_path}): {exc}") from None
