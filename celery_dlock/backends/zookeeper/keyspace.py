"""Where one backend's lock nodes live on one ensemble: the base path, each key's parent node,
this process's client for it, and the error that names the ensemble when it fails.

::

    <chroot>/<prefix>/<quoted key>/<lock nodes>

``<chroot>`` comes from the ``zookeeper://`` URL, ``<prefix>`` is ``dlock_prefix``; the key is
quoted into one node name (:func:`celery_dlock.backends.zookeeper.nodes.key_name`).
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from celery_dlock.backends.zookeeper.nodes import key_name
from celery_dlock.backends.zookeeper.session import SharedClient, shared
from celery_dlock.backends.zookeeper.url import ZkUrl, parse
from celery_dlock.core.config import Settings, drift
from celery_dlock.core.errors import ConfigError, LockUnavailable


class Keyspace:
    """The nodes of one backend (one URL and prefix) and the settings they are used with."""

    def __init__(self, settings: Settings) -> None:
        """From checked :class:`Settings` whose one URL is a ``zookeeper://`` URL."""
        self.url: ZkUrl = parse(settings.urls[0])
        prefix = settings.prefix
        if "/" in prefix or prefix in (".", ".."):
            raise ConfigError(
                f"dlock_prefix {prefix!r} cannot name a ZooKeeper node: use a non-empty name "
                "without '/', e.g. 'dlock'."
            )
        self.prefix = prefix
        self.ttl = settings.ttl
        self.drift_factor = settings.drift_factor
        self.base = f"{self.url.chroot}/{prefix}"

    @property
    def shared(self) -> SharedClient:
        """This process's client for the ensemble (a new one after fork)."""
        return shared(self.url)

    def client(self) -> tuple[SharedClient, KazooClient]:
        """This process's client, connected (:class:`LockUnavailable` when no server answers)."""
        session = self.shared
        return session, session.start()

    def parent(self, key: str) -> str:
        """The key's parent node, under which its contenders queue."""
        return f"{self.base}/{key_name(key)}"

    def validity(self, session: SharedClient) -> float:
        """How long after sending a request that is answered the session surely lives."""
        return session.negotiated - drift(session.negotiated, self.drift_factor)

    def lease_validity(self, session: SharedClient, ttl: float) -> float:
        """How long after sending a request that is answered a session node's lease is valid:
        while the session surely lives, and no longer than its ``ttl`` (minus the drift
        allowance), the meaning ``lock_ttl`` has on every backend."""
        return min(self.validity(session), ttl - drift(ttl, self.drift_factor))

    def unavailable(self, key: str, doing: str, exc: BaseException) -> LockUnavailable:
        """The error for a request about ``key`` that failed with ``exc`` (``doing``: what we
        tried, as in "cannot lock 'k'")."""
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, NoAuthError):
            # Nodes made with digest credentials carry an ACL for that user alone.
            user = self.url.user
            who = f"user {user!r}" if user is not None else "a client without credentials"
            detail = (
                f"{detail}: the ACL of the nodes under {self.base} does not let {who} in "
                "(another ZooKeeper user made them); put that user's credentials in the URL "
                "(zookeeper://user:password@hosts/chroot), or use another chroot"
            )
        return LockUnavailable(
            f"cannot {doing} {key!r} on ZooKeeper {self.url.shown}: {detail}",
            key=key,
            errors=[(self.url.shown, detail)],
        )
