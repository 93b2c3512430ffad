"""The training stage: the EAGLE-3 drafter, trained by ``speculators`` in a child process.

- :mod:`~eagleflow.train.step`: ``python -m eagleflow train`` (checks, then the child);
- :mod:`~eagleflow.train.config`: its flags;
- :mod:`~eagleflow.train.resume`: where a run stands and what a rerun resumes from;
- :mod:`~eagleflow.train.child`: device, speculators flags, the child process and its signals;
- :mod:`~eagleflow.train.speculators_entry`: what runs inside the child (CPU shims, metric capture);
- :mod:`~eagleflow.train.recorder`: speculators' metric dicts -> ``metrics.jsonl`` and the log;
- :mod:`~eagleflow.train.verifier_head`: the verifier as speculators reads it.

The config is exported here (pydantic only), so the Params form and the operators can use it
without torch.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "config": ["TrainConfig"],
    },
)
