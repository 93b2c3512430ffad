"""What the evaluation asks of DSpark (the registry's ``calibration`` owner): where an engine records each verify's
confidence, and the fit of a recording on held-out prompts into the file SGLang reads
(``--speculative-dspark-confidence-sts-path``), with the calibration error before and after.

The fit is :func:`eagleflow.drafters.dspark.calibration.fit_temperatures`, SGLang's own ``dspark_sts_fit`` step for
step; the recording the reference engine writes is :class:`~eagleflow.drafters.dspark.calibration.StsRecorder`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleflow.drafters.dspark.calibration import COLLECT_ENV, STS_FLAG, fit_temperatures, read_records, write_calibration

STS_FILE = "dspark-sts.json"  # in the evaluation's folder: it is fitted there, from what the evaluation decoded


@dataclass(frozen=True)
class StsCalibrationStep:
    """The evaluation's calibration of a DSpark drafter: ``env`` names the recording to a serving engine."""

    env: str = COLLECT_ENV

    def fit(self, recording: Path, out: Path, dataset: str) -> dict[str, Any]:
        """Fit the recording's temperatures, write :data:`STS_FILE` into ``out``; what the report says of it."""
        records = read_records(recording)
        calibration = fit_temperatures(records, dataset=dataset)
        path = write_calibration(out / STS_FILE, calibration)
        return {
            "path": str(path), "flag": [STS_FLAG, str(path)], "records": len(records), "dataset": dataset,
            "temperatures": list(calibration.temperatures), "ece_before": list(calibration.ece_before),
            "ece_after": list(calibration.ece_after),
        }


CALIBRATION = StsCalibrationStep()
