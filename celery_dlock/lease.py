"""The path ``Lease`` had before :mod:`celery_dlock.core` held it: c53a04b's example project
imported it from here for type hints (``from celery_dlock.lease import Lease``). Import it from
:mod:`celery_dlock`."""

from celery_dlock.core.lease import Lease

__all__ = ["Lease"]
