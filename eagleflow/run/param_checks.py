"""The path Params checked before anything starts, each refusal in plain words naming the Param by its label.

A wrong path found hours into a run (a model folder that is not one, a prompt file that moved) costs the
engines' warmup and more; the first task (``plan_engines``) runs :func:`check_paths`, every task that
reads the model :func:`check_model_folder`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eagleflow.errors import UserError
from eagleflow.files import path_problem

if TYPE_CHECKING:
    from eagleflow.run.pipeline import PipelineConfig


def check_model_folder(cfg: PipelineConfig) -> None:
    """Param model_path names a model folder: one that exists, is a folder, and holds config.json."""
    from eagleflow.verifier import model_folder_problem
    from eagleflow.run.pipeline import param_name

    if why := model_folder_problem(Path(cfg.model_path)):
        raise UserError(f"{param_name('model_path')}: {cfg.model_path} {why}")


def check_paths(cfg: PipelineConfig) -> None:
    """Every path Param: ``does not exist``, ``is not a folder``, ``has no config.json``, ``is not a file``."""
    from eagleflow.run.pipeline import param_name

    check_model_folder(cfg)
    wanted = {"dataset_input": (cfg.dataset_input, "file"), "eval_prompts": (cfg.step_param("eval_prompts"), "file"),
              "draft_config": (cfg.step_param("draft_config"), "file"), "server_dump_dir": (cfg.server_dump_dir, "folder")}
    for name, (path, kind) in wanted.items():
        if path and (why := path_problem(Path(path), kind)):  # type: ignore[arg-type]
            raise UserError(f"{param_name(name)}: {path} {why}")
    if Path(cfg.output_root).exists() and (why := path_problem(Path(cfg.output_root), "folder")):
        raise UserError(f"{param_name('output_root')}: {cfg.output_root} {why}")


def check_against_verifier(cfg: PipelineConfig) -> None:
    """What needs the verifier's folder and would otherwise fail hours later: each drafter's settings by its family's
    SGLang rules (:meth:`~eagleflow.run.drafters.RunDrafters.check_drafters_against_verifier`) and the chat
    template's switches (``chat_template_kwargs``: a switch its template never reads, a key of apply_chat_template)."""
    from eagleflow.data import check_chat_template_kwargs
    from eagleflow.run.pipeline import param_name

    cfg.check_drafters_against_verifier()
    kwargs = cfg.run_step_param("chat_template_kwargs")
    if kwargs:
        check_chat_template_kwargs(cfg.model_path, kwargs, name=param_name("chat_template_kwargs"))
