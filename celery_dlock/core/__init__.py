"""The lock core, which knows no Celery and no lock store: errors, settings, who holds a key,
the lease and its renewal, the background work, the ``Backend`` protocol (the seam every lock
store implements), the choice of backend by URL scheme, and ``lock()`` for any code."""
