"""What a run's folders say, read back for people: the run page, each drafter's part, the comparison.

- :mod:`~eagleflow.report.shapes`: the shape every report file is read in (evaluation, comparison, training,
  capture check), one declaration each;
- :mod:`~eagleflow.report.run_files`: the one reader of a run folder's files (:class:`RunFiles`) and the
  sections a page shares;
- :mod:`~eagleflow.report.drafters`: the drafters of a run that trains several, and the winner;
- :mod:`~eagleflow.report.run_page`: a whole run, and the list of runs (the UI plugin's pages, ``make demo``'s summary);
- :mod:`~eagleflow.report.compare`: ``python -m eagleflow compare``, every drafter of a run side by side
  (``eval/compare.json``), read from their evaluation reports.

Above the stages (it reads what they wrote), below the run (the run's config names the compare step).
Light: no torch, so the Airflow API server imports it.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "run_page": ["list_runs", "readable_files", "run_summary"],
        "run_files": ["MetricsCache", "RunFiles"],
        "compare": ["CompareConfig"],
    },
)
