"""Flags of ``python -m eagleflow verify-capture``, declared once (the Params form shows ``verify_rows``).

Light on purpose (pydantic only): :mod:`eagleflow.run.pipeline`, which the DAG file imports, reads it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from eagleflow.config import AuxLayerIds, SampleStoreAddress, StoredHiddenStatesDtype
from eagleflow.engine import EngineRequestSettings

# The log-probability tolerance per position is atol + rtol x that position's largest |logit|.
# bf16 keeps 8 significant bits: the engine's logits and the captured state are each within 2^-9
# of their size, and a log-probability carries up to twice its logits' error, hence 2^-7. fp8
# (e4m3) keeps 4: the stored state is within 2^-4 of each element, which then dominates.
LOGPROB_RTOL = {"bf16": 2.0**-7, "fp8": 2.0**-4}


class VerifyCaptureConfig(EngineRequestSettings):
    """Flags of ``python -m eagleflow verify-capture``."""

    dataset: Path = Field(description="the prepared training dataset (rows are taken from its start)")
    server: str = Field(description="engine base URL, e.g. http://127.0.0.1:30000")
    dump_dir: Path = Field(description="folder where the engine writes <rid>.safetensors")
    sample_store: SampleStoreAddress
    verifier: Path = Field(description="verifier model folder: its final norm and lm_head (and embedding rows) are read")
    aux_layer_ids: AuxLayerIds = Field(description="captured layer ids, as the engine captures them")
    verify_rows: int = Field(
        4, ge=1, le=64, title="Capture check rows",
        description="Rows from the dataset's start sent to check the engine's capture (final state against the engine's "
        "own log-probabilities, id 0, every slot) before any extraction.",
    )
    max_tokens: int = Field(256, ge=2, description="each row is cut to its first this many tokens")
    top_logprobs_num: int = Field(5, ge=1, le=100, description="the engine's top log-probabilities compared per position")
    hidden_states_dtype: StoredHiddenStatesDtype
    logprob_atol: float = Field(0.02, gt=0, description="log-probability tolerance, absolute part (nats)")
    logprob_rtol: float | None = Field(
        None, ge=0, title="Capture check: relative log-prob tolerance", description="log-probability tolerance per position, times that position's largest |logit|; "
        f"default by --hidden-states-dtype: {LOGPROB_RTOL} (their rounding)",
    )
    out: Path | None = Field(None, description="folder for report.json; default: the run folder's verify/engine-0/ beside --dataset")
    dump_wait: float = Field(60.0, ge=0, description="seconds to wait for a dump to appear after the answer")

    @property
    def rtol(self) -> float:
        """``logprob_rtol``, or the storage dtype's rounding when not given."""
        return self.logprob_rtol if self.logprob_rtol is not None else LOGPROB_RTOL[self.hidden_states_dtype]
