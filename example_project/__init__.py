"""The example project: a production team's replication service and metadata-table
collector, written with celery_dlock, and the demo that runs them against their plain-Celery twins.

* :mod:`example_project.tasks` — the tasks (the part to copy);
* :mod:`example_project.metadata` — the metadata table with fenced writes;
* :mod:`example_project.api` — the rate-limited external API the collectors call;
* :mod:`example_project.demo` — ``python -m example_project``.
"""
