"""What the tests use and are not tests themselves: server fixtures (Redis, Sentinel, Cluster,
ZooKeeper, RabbitMQ, TLS proxies, a fault proxy), the Celery apps real ``celery worker``
processes run (``-A tests.support.worker_app`` and its siblings), worker and journal helpers,
the fault-injection harness (``python -m tests.support.faults``) and the peer libraries'
example projects."""
