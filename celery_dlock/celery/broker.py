"""The broker setting as lock URLs: with ``dlock_urls`` not set, the locks live on the broker's
Redis. Kombu spells broker URLs its own way (``redis+socket://``, ``sentinel://`` lists with the
group name in the transport options); this module turns them into the lock URLs the backends
read, for :func:`celery_dlock.core.config.settings_from_app` (which it registers with, on
import: the core knows no broker).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from celery_dlock.core.config import broker_url, use_default_urls
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import redact

#: The setting the URLs of :func:`broker_lock_urls` come from, as their errors name it.
SETTING = "broker_url (used as dlock_urls is not set)"


def broker_lock_urls(conf: Any) -> list[str]:
    """The lock URL the broker setting gives when ``dlock_urls`` is not set."""
    broker = broker_url(conf) or ""
    shown = redact(str(broker)) or "unset"
    scheme = broker.split("://", 1)[0].lower() if isinstance(broker, str) else ""
    if ";" in str(broker) and scheme != "sentinel":
        raise ConfigError(
            f"dlock_urls is not set and the broker URL is a failover list ({shown}), which a "
            "lock cannot follow; set app.conf.dlock_urls = ['redis://host:6379/0'] (or three "
            "or more independent masters for Redlock)."
        )
    if scheme in ("redis", "rediss"):
        rest = broker.split("://", 1)[1]
        # kombu reads a bare redis:// as the local default server
        return [broker if rest.strip("/") else f"{scheme}://localhost:6379/0"]
    if scheme == "redis+socket":  # kombu's Unix-socket Redis
        return ["unix://" + broker.split("://", 1)[1]]
    if scheme == "sentinel":
        return [sentinel_url_from_kombu(broker, conf.get("broker_transport_options") or {})]
    raise ConfigError(
        f"dlock_urls is not set and the broker is not Redis ({shown}); set "
        "app.conf.dlock_urls = ['redis://host:6379/0'] (or three or more URLs for Redlock)."
    )


def default_lock_urls(conf: Any) -> tuple[list[str], str]:
    """:func:`broker_lock_urls` and the setting they came from (the core's default URLs)."""
    return broker_lock_urls(conf), SETTING


def sentinel_url_from_kombu(broker: str, transport_options: Any) -> str:
    """Celery's Sentinel broker setting as one ``redis+sentinel://`` URL.

    Kombu spells it ``sentinel://:pw@host:26379/0;sentinel://host2:26379`` with the group name
    in ``broker_transport_options["master_name"]`` and the sentinels' own password, if any, in
    ``broker_transport_options["sentinel_kwargs"]["password"]``.
    """
    master = transport_options.get("master_name")
    if not master:
        raise ConfigError(
            f"dlock_urls is not set and the broker is Sentinel ({redact(broker)}) without "
            "broker_transport_options['master_name']; set it, or set app.conf.dlock_urls = "
            "['redis+sentinel://host:26379,host2:26379/mymaster/0']."
        )
    hosts: list[str] = []
    auth = db = ""
    for part in filter(None, (p.strip() for p in broker.split(";"))):
        rest = part.split("://", 1)[-1]
        userinfo, _, hostpath = rest.rpartition("@")
        auth = auth or (f"{userinfo}@" if userinfo else "")
        host, _, path = hostpath.partition("/")
        hosts.append(host)
        db = db or path.strip("/")
    query = ""
    sentinel_password = (transport_options.get("sentinel_kwargs") or {}).get("password")
    if sentinel_password:
        query = "?" + urlencode({"sentinel_password": sentinel_password})
    return f"redis+sentinel://{auth}{','.join(hosts)}/{master}/{db or 0}{query}"


use_default_urls(default_lock_urls)
