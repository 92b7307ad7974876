"""The lock stores, each a subpackage that implements :class:`celery_dlock.core.backend.Backend`
and is imported by name from its URL scheme (:mod:`celery_dlock.core.registry`): none imports
another, and nothing outside ``redis/`` imports redis-py."""
