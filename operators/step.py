"""``EagleflowStepOperator``: run one ``python -m eagleflow <step>`` as a child process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

# REFUSAL_XCOM: the first task's refusal of the run's Params, in its one sentence (XCom key of plan_engines): the run's
# last task leads its message with it, and the UI plugin's runs list shows it for a run that failed before its folder.
from eagleflow.deploy import REFUSAL_XCOM
from eagleflow.errors import UserError

if TYPE_CHECKING:
    from airflow.sdk import Context

    from eagleflow.run.pipeline import PipelineConfig

KILL_GRACE_SECONDS = 30
ERROR_TAIL_LINES = 30


def step_python() -> str:
    """Interpreter for the steps: ``EAGLEFLOW_PYTHON`` lets a deployment point them at another environment."""
    return os.environ.get("EAGLEFLOW_PYTHON") or sys.executable


def pipeline_config(context: Context, check_model: bool = True, check_paths: bool = False) -> PipelineConfig:
    """The run's Params as a validated :class:`PipelineConfig` (a bad Param fails here, named, as its message).

    With ``check_model`` (every task but the teardown) the Params that need the model folder
    are checked too, so a bad aux id list fails the first task that starts, not an extraction;
    with ``check_paths`` (the first task) every path Param (:func:`eagleflow.run.param_checks.check_paths`), the
    model's, and what the verifier's folder decides of each drafter and of the chat template's switches
    (:func:`eagleflow.run.param_checks.check_against_verifier`).
    """
    from eagleflow.run.pipeline import PipelineConfig

    try:
        cfg = PipelineConfig.from_params(context["params"], context["run_id"])
        if check_paths:
            from eagleflow.run.param_checks import check_against_verifier, check_paths as check_path_params

            check_path_params(cfg)
            cfg.check_model()
            check_against_verifier(cfg)
        return cfg.check_model() if check_model else cfg
    except UserError as exc:
        if check_paths and context.get("ti") is not None:  # the first task: its sentence is what the last task and the runs list say
            context["ti"].xcom_push(key=REFUSAL_XCOM, value=str(exc))
        raise ParamsRefused(str(exc)) from None  # the message is the report: no chain of frames under it


class ParamsRefused(AirflowFailException, UserError):
    """A run's Params refused, with the reason in plain words; no retry (the same Params fail alike)."""


def drafter_config(context: Context, drafter: dict[str, Any] | None) -> PipelineConfig:
    """The run's config seen from ``drafter`` (an entry of ``plan_drafters``; None: the run's one drafter)."""
    cfg = pipeline_config(context)
    return cfg.for_drafter(drafter) if drafter else cfg


class StepFailed(Exception):
    """The step's child process exited non-zero; ``returncode`` and ``tail`` say how."""

    def __init__(self, step: str, returncode: int, tail: str) -> None:
        self.step, self.returncode, self.tail = step, returncode, tail
        super().__init__(f"python -m eagleflow {step} exited with code {returncode}; last lines:\n{tail}")


class EagleflowStepOperator(BaseOperator):
    """Run ``python -m eagleflow <step> <argv>``, stream its output, return its result line.

    Subclasses override :meth:`step_argv` to build the argv from the run's
    :class:`~eagleflow.run.pipeline.PipelineConfig` and upstream XCom; the default passes
    ``arguments`` through. The child runs in its own session so :meth:`on_kill` can stop it
    and everything it started; its output is unbuffered so the task log is live.

    :param step: the eagleflow step, e.g. ``"prepare-dataset"``.
    :param arguments: extra argv for the step (templated).
    """

    template_fields: Sequence[str] = ("arguments",)
    ui_color = "#e8f0fe"

    def __init__(self, *, step: str, arguments: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step = step
        self.arguments = arguments or []
        self._process: subprocess.Popen[str] | None = None

    def step_argv(self, context: Context) -> list[str]:
        """Flags for the step; subclasses build them from Params and XCom."""
        return [str(a) for a in self.arguments]

    def execute(self, context: Context) -> Any:
        if self.operator_extra_links:
            from operators.links import push_run_name

            # first thing, so the "eagleflow run" button works even when the step then fails
            push_run_name(context, str(pipeline_config(context).run_name))
        return self.run_step(self.step, self.step_argv(context))

    def run_step(self, step: str, argv: list[str]) -> dict[str, Any] | None:
        """Run the step to completion; return the dict it printed as its result (or None)."""
        from eagleflow.results import RESULT_PREFIX, find_result

        command = [step_python(), "-u", "-m", "eagleflow", step, *argv]
        self.log.info("Running: %s", subprocess.list2cmdline(command))
        tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
        results: list[str] = []
        from eagleflow.__main__ import PARENT_PID_ENV

        # The step dies with this task process even when it is killed without on_kill.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())}
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.rstrip("\n")
            if line.startswith(RESULT_PREFIX):
                results.append(line)
            self.log.info("%s", line)
            tail.append(line)
        returncode = self._process.wait()
        self._process = None
        if returncode != 0:
            raise StepFailed(step, returncode, "\n".join(tail))
        return find_result(results)

    def on_kill(self) -> None:
        """Stop the step's whole process group: SIGTERM (it saves what it can), then SIGKILL."""
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.log.warning("step %s ignored SIGTERM for %ss; killing it", self.step, KILL_GRACE_SECONDS)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except Exception:  # on_kill must not raise
            self.log.exception("could not stop step %s", self.step)
        # Group members left once the step's own process is gone (a worker that ignores SIGTERM)
        # still hold its output pipe, and run_step would wait on that pipe for ever.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
