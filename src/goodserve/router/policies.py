"""Routing policies: which backend serves a request. Torch-free and I/O-free, so the HTTP router
(:mod:`goodserve.router.app`) and the simulator drive the same code.

A policy sees a list of :class:`BackendState` (plain data the caller keeps current) and one
:class:`RouteRequest`, and returns the index of the backend to use. Unhealthy backends are never chosen;
when none is healthy, :class:`NoHealthyBackendError` is raised. The caller does the bookkeeping of the
chosen backend (:meth:`BackendState.start` / :meth:`BackendState.finish`).

Policies (``POLICIES`` maps the CLI names to classes):

- ``round-robin``: healthy backends in turn.
- ``least-outstanding-tokens``: fewest in-flight tokens; ties by fewest in-flight requests, then index.
  :class:`LeastLoaded` with another ``metric`` picks a P/D pool's instance: ``queued_prefill_tokens`` for
  prefill, ``kv_usage`` for decode.
- ``prefix-affinity``: send a prompt to the backend that served its longest known prefix (its KV blocks are
  likely still in that backend's prefix cache), unless that backend is overloaded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# A prompt given as text has no token count at the router (it has no tokenizer): it is estimated at this many
# UTF-8 bytes per token (about right for English with a BPE vocabulary of ~50k).
BYTES_PER_TOKEN = 4
# max_tokens assumed for the load accounting of a request that does not state it.
DEFAULT_MAX_TOKENS = 256


class NoHealthyBackendError(Exception):
    """No backend of the needed kind is healthy (the HTTP router answers 503)."""


@dataclass
class BackendState:
    """What a policy knows about one backend. Counters cover requests the router has in flight there.

    Attributes:
        name: The backend's identity (the HTTP router uses its base URL).
        healthy: False after a failed connection or health probe; never chosen while False.
        outstanding_requests: Requests sent and not yet finished.
        outstanding_tokens: Sum of ``prompt_tokens + max_tokens`` of those requests (tokens).
        queued_prefill_tokens: Prompt tokens of those requests whose first output has not arrived yet.
        kv_usage: Fraction of the backend's KV blocks in use (0-1), if known (e.g. scraped or simulated).
    """

    name: str
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: Optional[float] = None

    def start(self, request: "RouteRequest") -> None:
        """Count ``request`` as sent here (not yet prefilled)."""
        self.outstanding_requests += 1
        self.outstanding_tokens += request.total_tokens
        self.queued_prefill_tokens += request.prompt_tokens

    def prefilled(self, request: "RouteRequest") -> None:
        """Count ``request``'s prompt as prefilled (its first output arrived). Call at most once per request."""
        self.queued_prefill_tokens -= request.prompt_tokens

    def finish(self, request: "RouteRequest", prefilled: bool) -> None:
        """Count ``request`` as finished (or failed); ``prefilled`` says whether :meth:`prefilled` was called."""
        self.outstanding_requests -= 1
        self.outstanding_tokens -= request.total_tokens
        if not prefilled:
            self.queued_prefill_tokens -= request.prompt_tokens


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about one request.

    Attributes:
        prompt_tokens: Prompt length in tokens (exact for token ids, estimated for text).
        max_tokens: Output tokens the request may generate.
        token_ids: The prompt's token ids, if the client sent ids.
        text: Otherwise the prompt as text (for chat, the messages serialised as canonical JSON).
    """

    prompt_tokens: int
    max_tokens: int
    token_ids: Optional[tuple[int, ...]] = None
    text: Optional[str] = None

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + max_tokens``: what the request adds to a backend's outstanding tokens."""
        return self.prompt_tokens + self.max_tokens

    @classmethod
    def from_openai_body(cls, body: dict[str, Any]) -> "RouteRequest":
        """Read an OpenAI completions or chat request body leniently (the backend validates it).

        Token ids are used when ``prompt`` is a list of ints (or a batch whose first entry is); a text prompt
        (or the first of a batch) is used as is; ``messages`` become ``json.dumps(messages, sort_keys=True)``,
        whose prefix survives appending a turn. Anything else counts as an empty prompt.
        """
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            max_tokens = DEFAULT_MAX_TOKENS
        prompt: Any = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = tuple(prompt)
            return cls(prompt_tokens=len(ids), max_tokens=max_tokens, token_ids=ids)
        if "messages" in body:
            try:
                prompt = json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
            except (TypeError, ValueError):
                prompt = ""
        text = prompt if isinstance(prompt, str) else ""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        return cls(prompt_tokens=math.ceil(nbytes / BYTES_PER_TOKEN), max_tokens=max_tokens, text=text)


def _healthy(backends: Sequence[BackendState]) -> list[int]:
    idx = [i for i, b in enumerate(backends) if b.healthy]
    if not idx:
        raise NoHealthyBackendError(f"none of the {len(backends)} backends is healthy")
    return idx


class RoutingPolicy:
    """Interface: ``select(backends, request) -> index``.

    Raises:
        NoHealthyBackendError: if no backend in ``backends`` is healthy.
    """

    name = ""

    def select(self, backends: Sequence[BackendState], request: RouteRequest) -> int:
        raise NotImplementedError


class RoundRobin(RoutingPolicy):
    """The next healthy backend after the last one chosen (by index, wrapping around)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last = -1

    def select(self, backends: Sequence[BackendState], request: RouteRequest) -> int:
        healthy = _healthy(backends)
        self._last = next((i for i in healthy if i > self._last), healthy[0])
        return self._last


class LeastLoaded(RoutingPolicy):
    """The healthy backend with the smallest ``metric``; ties by outstanding tokens, then outstanding
    requests, then index.

    Args:
        metric: A :class:`BackendState` field: ``outstanding_tokens`` (the ``least-outstanding-tokens``
            policy), ``queued_prefill_tokens`` (a P/D prefill pool) or ``kv_usage`` (a decode pool; an
            unknown usage counts as 0, so the tie-breaks decide).
    """

    name = "least-outstanding-tokens"
    METRICS = ("outstanding_tokens", "queued_prefill_tokens", "kv_usage", "outstanding_requests")

    def __init__(self, metric: str = "outstanding_tokens") -> None:
        if metric not in self.METRICS:
            raise ValueError(f"metric must be one of {self.METRICS}, got {metric!r}")
        self.metric = metric

    def key(self, backends: Sequence[BackendState], i: int) -> tuple:
        b = backends[i]
        return (getattr(b, self.metric) or 0, b.outstanding_tokens, b.outstanding_requests, i)

    def select(self, backends: Sequence[BackendState], request: RouteRequest) -> int:
        return min(_healthy(backends), key=lambda i: self.key(backends, i))


class PrefixAffinity(RoutingPolicy):
    """Route to the backend that served the longest known prefix of the prompt, within a load bound.

    The prompt's first ``max_blocks`` full blocks are hashed in a chain (each digest covers its block and
    its parent's digest, like vLLM's prefix-cache block hashes), so a matching digest means a matching whole
    prefix. Blocks are ``block_size`` token ids when the client sent ids, else ``block_bytes`` bytes of the
    text's UTF-8 encoding (chat: of the canonical JSON of the messages); the two never match each other.
    After every choice, the request's digests are recorded as held by the chosen backend, in an LRU table of
    at most ``max_entries`` digests.

    The backend holding the longest matching chain is chosen unless it is unhealthy or overloaded:
    ``outstanding_tokens > (1 + balance_slack) * mean + balance_abs_tokens`` over the healthy backends; then
    (and when nothing matches) the least-outstanding-tokens backend is. The bound follows the balance
    thresholds of SGLang's cache-aware router (``balance_rel_threshold`` / ``balance_abs_threshold``: cache
    affinity only while the load is not too imbalanced) and Ray Serve's ``PrefixCacheAffinityRouter``
    (``imbalanced_threshold``), written here relative to the mean.

    Args:
        block_size: Tokens per block for token-id prompts.
        block_bytes: UTF-8 bytes per block for text prompts (64 bytes: about 16 tokens).
        max_blocks: Only the first this many blocks are hashed (bounds the work per request).
        max_entries: Capacity of the digest table (16-byte digests: ~100 bytes per entry with the dict).
        balance_slack: Relative allowance over the mean outstanding tokens (0.5 = 50%).
        balance_abs_tokens: Absolute allowance, tokens.

    Raises:
        ValueError: if a size is < 1 or an allowance < 0.
    """

    name = "prefix-affinity"

    def __init__(self, block_size: int = 16, block_bytes: int = 64, max_blocks: int = 256,
                 max_entries: int = 100_000, balance_slack: float = 0.5, balance_abs_tokens: int = 1024) -> None:
        if min(block_size, block_bytes, max_blocks, max_entries) < 1:
            raise ValueError("block_size, block_bytes, max_blocks and max_entries must be >= 1")
        if balance_slack < 0 or balance_abs_tokens < 0:
            raise ValueError("balance_slack and balance_abs_tokens must be >= 0")
        self.block_size, self.block_bytes, self.max_blocks = block_size, block_bytes, max_blocks
        self.max_entries, self.balance_slack, self.balance_abs_tokens = max_entries, balance_slack, balance_abs_tokens
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # digest -> backend name, least recently used first
        self._fallback = LeastLoaded()

    def block_hashes(self, request: RouteRequest) -> list[bytes]:
        """Chained 16-byte BLAKE2b digests of the request's first full blocks (a partial block is skipped)."""
        if request.token_ids is not None:
            data, size, tag = b"".join(t.to_bytes(8, "little", signed=True) for t in request.token_ids), 8 * self.block_size, b"t"
        else:
            data, size, tag = (request.text or "").encode("utf-8", "surrogatepass"), self.block_bytes, b"b"
        hashes, parent = [], tag
        for start in range(0, min(len(data) // size, self.max_blocks) * size, size):
            parent = hashlib.blake2b(parent + data[start:start + size], digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def is_overloaded(self, backends: Sequence[BackendState], i: int) -> bool:
        """Whether backend ``i`` is over the load bound (see the class docstring)."""
        healthy = _healthy(backends)
        mean = sum(backends[j].outstanding_tokens for j in healthy) / len(healthy)
        return backends[i].outstanding_tokens > (1 + self.balance_slack) * mean + self.balance_abs_tokens

    def select(self, backends: Sequence[BackendState], request: RouteRequest) -> int:
        healthy = _healthy(backends)
        hashes = self.block_hashes(request)
        index = {backends[i].name: i for i in healthy}
        chosen = None
        for h in hashes:  # digests chain: stop at the first miss; the deepest hit is the longest prefix
            owner = self._owner.get(h)
            if owner is None:
                break
            if owner in index:
                chosen = index[owner]
        if chosen is None or self.is_overloaded(backends, chosen):
            chosen = self._fallback.select(backends, request)
        name = backends[chosen].name
        for h in hashes:
            self._owner[h] = name
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen


POLICIES = {"round-robin": RoundRobin, "least-outstanding-tokens": LeastLoaded, "prefix-affinity": PrefixAffinity}


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A policy by its CLI name (``POLICIES``), with its constructor's keyword arguments.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
