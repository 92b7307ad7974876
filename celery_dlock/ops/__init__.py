"""What an operator does to locks: :mod:`~celery_dlock.ops.admin` (from Python, public as
``celery_dlock.admin``) and the ``celery dlock`` command (:mod:`~celery_dlock.ops.cli`)."""
