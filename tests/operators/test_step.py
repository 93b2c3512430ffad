"""``EagleflowStepOperator``: what a step inherits from the task that starts it.

The step is a real child process: ``EAGLEFLOW_PYTHON`` points the operator at a stand-in
interpreter that starts the way ``python -m eagleflow`` starts, then launches another
``python -m eagleflow`` process, as ``evaluate`` launches its engines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from operators.step import EagleflowStepOperator

# The step's own start (eagleflow.__main__.main, which arms the parent-death signal), then a
# grandchild started with the step's environment; the step exits with the grandchild's status.
STEP_THAT_STARTS_ANOTHER = r"""
import subprocess, sys
from eagleflow.__main__ import main
try:
    main(["check-disk", "--help"])
except SystemExit:
    pass
grandchild = subprocess.run([sys.executable, "-m", "eagleflow", "check-disk", "--help"], stdout=subprocess.DEVNULL)
print("grandchild exit:", grandchild.returncode, flush=True)
sys.exit(0 if grandchild.returncode == 0 else 3)
"""


def test_a_process_the_step_starts_does_not_take_the_step_s_parent_for_its_own(
    step_interpreter: Callable[[str], Path],
) -> None:
    """The parent-death variable names the step's parent; a grandchild that read it saw another
    parent and stopped itself at once (evaluate's engines died before printing a line)."""
    step_interpreter(STEP_THAT_STARTS_ANOTHER)
    EagleflowStepOperator(task_id="check_disk", step="check-disk").run_step("check-disk", ["--help"])
