"""The module ``DLockConfigWarning`` had before :mod:`celery_dlock.core` held it: a warnings
filter names a class by its module (``ignore::celery_dlock.config.DLockConfigWarning`` in a
project's pytest configuration), and pytest imports that module when it starts. Import the
class from :mod:`celery_dlock`."""

from celery_dlock.core.config import DLockConfigWarning

__all__ = ["DLockConfigWarning"]
