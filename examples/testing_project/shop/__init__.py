"""A small shop's Celery tasks (the project docs/testing.md tests)."""
