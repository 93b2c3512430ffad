"""Thin Airflow adapters over eagleflow's steps: operators, sensors and triggers.

Each turns the run's Params and upstream XCom into the argv of ``python -m eagleflow <step>``
(or one core call), streams the child's output into the task log, and returns a small JSON
XCom. eagleflow itself is imported lazily, inside ``execute``.
"""
