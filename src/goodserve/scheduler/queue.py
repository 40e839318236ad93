"""Waiting queues: the order in which waiting (and preempted) requests are admitted. Each scheduling
policy builds its own (:meth:`goodserve.scheduler.policy.StepPolicy.make_queue`):

* :class:`FCFSQueue` (``fcfs``): arrival order; a preempted request goes back to the head, so it is
  readmitted first.
* :class:`SortedQueue` by a key: ``priority`` sorts by ``(priority, arrival_time, insertion seq)``, so a
  preempted request re-inserted under its original priority and arrival time precedes later arrivals;
  ``slo`` by its latest start (:meth:`goodserve.scheduler.slo.SLOPolicy.queue_key`), late requests last (a
  request whose key changes is removed and added again).
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable, Iterator

from goodserve.request import Request


class RequestQueue(ABC):
    """Common interface of the waiting queues."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a preempted request where the policy says it resumes (ahead of new arrivals)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit. Raises ``IndexError`` when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit. Raises ``IndexError`` when empty."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a given request (abort). Raises ``ValueError`` if it is not queued."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    def readd(self, request: Request) -> None:
        """Alias of :meth:`prepend`."""
        self.prepend(request)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSQueue(RequestQueue):
    """First come, first served: a deque in arrival order; preempted requests return to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class SortedQueue(RequestQueue):
    """Ordered by ``(key(request), insertion seq)``, smallest first; preempted requests are re-inserted by key.

    A sorted list kept with :mod:`bisect`: O(log n) search and an O(n) memmove per insert, cheap at the
    queue lengths of a serving engine, and iteration in admission order is free.

    Args:
        key: The request's sort key, computed once when it is inserted.
    """

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._entries: list[tuple[Any, int, Request]] = []
        self._seq = itertools.count()

    def _insert(self, request: Request) -> None:
        bisect.insort(self._entries, (self._key(request), next(self._seq), request), key=lambda e: e[:2])

    def add(self, request: Request) -> None:
        self._insert(request)

    def prepend(self, request: Request) -> None:
        self._insert(request)

    def peek(self) -> Request:
        return self._entries[0][2]

    def pop(self) -> Request:
        return self._entries.pop(0)[2]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._entries):
            if entry[2] is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.request_id} is not in the waiting queue")

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in self._entries)
