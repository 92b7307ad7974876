"""The Celery layer: ``SingletonTask``, enqueue-time locks, the signal receivers, beat, the
interruption of a body whose lease is lost, task lock keys. It talks to a lock store only
through the ``Backend`` protocol of :mod:`celery_dlock.core`."""
