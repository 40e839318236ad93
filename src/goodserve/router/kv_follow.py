"""The router's link to its backends' KV events: finds each backend's publisher (``GET /v1/kv_events``) and
follows it (:class:`~goodserve.kv_events.subscriber.KVEventSubscriber`) into one
:class:`~goodserve.kv_events.index.KVIndex`, which the ``kv-aware`` policy and the P/D decode choice read.

A backend answering 404 publishes nothing: it has no view in the index (``kv-aware`` then falls back to
guessing, :class:`~goodserve.router.policies.KVAware`). A backend that comes back after being down is asked
again: a restarted instance may publish at other ports, and always with another ``stream_id``.
"""

from __future__ import annotations

import logging
from typing import Optional
from urllib.parse import urlsplit

import httpx

from goodserve.kv_events.events import InstanceLoad
from goodserve.kv_events.index import KVIndex
from goodserve.kv_events.subscriber import KVEventSubscriber

logger = logging.getLogger(__name__)
_ANY_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def connect_address(endpoint: str, backend_url: str) -> str:
    """``endpoint`` as the router must dial it: a wildcard host (the publisher bound every interface)
    becomes the backend URL's host."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in _ANY_HOSTS:
        return f"tcp://{urlsplit(backend_url).hostname}:{port}"
    return endpoint


class KVEventFollower:
    """Subscribers per backend URL, all feeding ``index`` (keyed by the backend URL).

    Args:
        index: The index to keep current.
    """

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.info: dict[str, Optional[dict]] = {}  # url -> the last /v1/kv_events answer (None: publishes none)

    async def check(self, client: httpx.AsyncClient, url: str, timeout: float) -> None:
        """Ask ``url`` where it publishes, and (re)subscribe if that changed. Transport errors are left to the
        health probe (this is retried when the backend is next found healthy)."""
        try:
            r = await client.get(url + "/v1/kv_events", timeout=timeout)
        except httpx.HTTPError as e:
            logger.debug("GET %s/v1/kv_events failed: %s", url, e)
            return
        try:
            if r.status_code != 200:
                raise ValueError(f"GET /v1/kv_events answered {r.status_code}")
            info = r.json()
            endpoint = connect_address(str(info["endpoint"]), url)
            replay = info.get("replay_endpoint")
            replay = connect_address(str(replay), url) if replay else None
            topic = str(info.get("topic", ""))
        except (ValueError, KeyError, TypeError) as e:
            if self.info.get(url, 0) is not None:  # said once per backend
                logger.debug("backend %s publishes no KV events (%s)", url, e)
            self.info[url] = None
            await self._drop(url)
            return
        old = self.subscribers.get(url)
        if old is not None and (old.endpoint, old.replay_endpoint, old.topic) == (endpoint, replay, topic):
            return  # same publisher sockets: the subscriber itself notices a new stream_id
        await self._drop(url)
        self.info[url] = info
        sub = self.subscribers[url] = KVEventSubscriber(url, endpoint, replay, self.index, topic)
        sub.start()
        logger.info("following the KV events of %s at %s", url, endpoint)

    async def _drop(self, url: str) -> None:
        sub = self.subscribers.pop(url, None)
        if sub is not None:
            await sub.close()
            self.index.forget(url)

    def load(self, url: str) -> Optional[InstanceLoad]:
        """The last load ``url`` published, if any."""
        view = self.index.instances.get(url)
        return view.load if view is not None else None

    def describe(self, url: str) -> dict:
        """For ``/health``: whether ``url`` publishes, and the index's view of it."""
        sub, view = self.subscribers.get(url), self.index.instances.get(url)
        return {"publishes": sub is not None, "stream_id": sub.stream_id if sub else None,
                "last_seq": sub.last_seq if sub else None, "batches": sub.num_batches if sub else 0,
                "replays": sub.num_replays if sub else 0, "cached_blocks": len(view.hashes) if view else 0}

    async def close(self) -> None:
        """Stop every subscriber."""
        for url in list(self.subscribers):
            await self._drop(url)
