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
- ``kv-aware``: the backend where the first token comes soonest, from the backends' real prefix caches (their
  KV events) and loads, priced in seconds by their step-time models (:class:`KVAware`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from goodserve.kv_events.events import InstanceLoad
from goodserve.kv_events.index import KVIndex
from goodserve.scheduler.step_time import DEFAULT_SEED, StepCoefficients

logger = logging.getLogger(__name__)

# A prompt given as text has no token count at the router (it has no tokenizer): it is estimated at this many
# UTF-8 bytes per token (about right for English with a BPE vocabulary of ~50k).
BYTES_PER_TOKEN = 4
# max_tokens assumed for the load accounting of a request that does not state it.
DEFAULT_MAX_TOKENS = 256
# kv-aware: predicted TTFTs this close to the best are a tie (fitted coefficients differ by rounding noise
# between instances), which the longer cache hit wins.
TIE_RTOL, TIE_ATOL_S = 1e-3, 1e-6


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
        queued_prefill_tokens: Prompt tokens still to compute of those requests whose first output has not
            arrived yet (the whole prompt, or what the policy predicted its prefix cache would not cover).
        queued_prefill_requests: How many requests those are.
        kv_usage: Fraction of the backend's KV blocks in use (0-1), if known (published in its KV events, or
            simulated).
    """

    name: str
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_requests: int = 0
    kv_usage: Optional[float] = None

    def start(self, request: "RouteRequest", prefill_tokens: Optional[int] = None) -> int:
        """Count ``request`` as sent here (not yet prefilled), with ``prefill_tokens`` to compute (default: its
        whole prompt). Returns that number, which :meth:`prefilled` and :meth:`finish` need back."""
        prefill = request.prompt_tokens if prefill_tokens is None else prefill_tokens
        self.outstanding_requests += 1
        self.outstanding_tokens += request.total_tokens
        self.queued_prefill_tokens += prefill
        self.queued_prefill_requests += 1
        return prefill

    def prefilled(self, request: "RouteRequest", prefill_tokens: Optional[int] = None) -> None:
        """Count ``request``'s prompt as prefilled (its first output arrived). Call at most once per request."""
        self.queued_prefill_tokens -= request.prompt_tokens if prefill_tokens is None else prefill_tokens
        self.queued_prefill_requests -= 1

    def finish(self, request: "RouteRequest", prefilled: bool, prefill_tokens: Optional[int] = None) -> None:
        """Count ``request`` as finished (or failed); ``prefilled`` says whether :meth:`prefilled` was called."""
        self.outstanding_requests -= 1
        self.outstanding_tokens -= request.total_tokens
        if not prefilled:
            self.prefilled(request, prefill_tokens)

    @property
    def decoding_requests(self) -> int:
        """Requests here past their prefill (decode rows of its batch, as far as the router knows)."""
        return self.outstanding_requests - self.queued_prefill_requests


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about one request.

    Attributes:
        prompt_tokens: Prompt length in tokens (exact for token ids, estimated for text).
        max_tokens: Output tokens the request may generate.
        token_ids: The prompt's token ids, if the client sent ids (or the router tokenized the prompt).
        text: Otherwise the prompt as text (for chat, the messages serialised as canonical JSON).
        cache_salt: The request's prefix-cache salt (its blocks hash with it, as in the engine).
    """

    prompt_tokens: int
    max_tokens: int
    token_ids: Optional[tuple[int, ...]] = None
    text: Optional[str] = None
    cache_salt: Optional[str] = None

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
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        prompt: Any = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = tuple(prompt)
            return cls(prompt_tokens=len(ids), max_tokens=max_tokens, token_ids=ids, cache_salt=salt)
        if "messages" in body:
            try:
                prompt = json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
            except (TypeError, ValueError):
                prompt = ""
        text = prompt if isinstance(prompt, str) else ""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        return cls(prompt_tokens=math.ceil(nbytes / BYTES_PER_TOKEN), max_tokens=max_tokens, text=text, cache_salt=salt)


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

    def prefill_tokens(self, backend: BackendState, request: RouteRequest) -> int:
        """Prompt tokens ``backend`` will compute for ``request`` just chosen (for its load accounting):
        the whole prompt, unless the policy knows what that backend has cached."""
        return request.prompt_tokens


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


def predicted_ttft_s(coefficients: StepCoefficients, queued_tokens: int, queued_requests: int, uncached: int,
                     cached: int, decode_rows: int, token_budget: int) -> float:
    """Seconds until a new request's first token on one instance, by its step-time model: the instance
    computes its queued prefill tokens and the request's uncached ones in chunks of the token budget left
    beside its decode rows, each chunk one step that also runs the decodes (chunked prefill, Sarathi-Serve
    §4; the step form of :class:`goodserve.scheduler.step_time.StepCoefficients`).

    Args:
        coefficients: The instance's step-time coefficients.
        queued_tokens: Prompt tokens of requests already routed there and not yet prefilled.
        queued_requests: How many requests those are (their causal pairs are priced as equal prompts).
        uncached: The new request's prompt tokens its prefix cache does not hold.
        cached: Its prompt tokens the cache holds (each uncached token attends to them).
        decode_rows: Requests decoding there.
        token_budget: Tokens per step (``max_num_batched_tokens``).

    Returns:
        The predicted time to first token (seconds).
    """
    tokens = queued_tokens + uncached
    steps = max(1, math.ceil(tokens / max(1, token_budget - decode_rows)))
    pairs = uncached * cached + uncached * (uncached + 1) // 2
    if queued_requests > 0:
        each = queued_tokens / queued_requests
        pairs += queued_requests * each * (each + 1) / 2
    c = coefficients
    per_row = c.per_token_s + c.per_sampled_s + c.prefill_per_sampled_s  # a decode row beside a chunk
    per_step = c.overhead_s + c.prefill_overhead_s + per_row * decode_rows
    return steps * per_step + c.per_token_s * tokens + c.per_pair_s * pairs


def predicted_decode_s(coefficients: StepCoefficients, output_tokens: int, decode_rows: int,
                       context_tokens: int) -> float:
    """Seconds a new request's decode takes on one instance, by its step-time model: ``output_tokens`` steps,
    each with the instance's decode rows and the request's own (every row one token), every row attending
    over the instance's resident context. This is what it adds a request's E2E latency, and what a crowded
    instance makes every TPOT longer by.

    Args:
        coefficients: The step-time coefficients.
        output_tokens: Tokens the request may generate (its ``max_tokens``).
        decode_rows: Requests decoding there now.
        context_tokens: Tokens resident there, the new request's included (keys each step's queries read).

    Returns:
        The predicted decode time (seconds).
    """
    c = coefficients
    rows = decode_rows + 1
    return output_tokens * (c.overhead_s + (c.per_token_s + c.per_sampled_s) * rows + c.per_pair_s * context_tokens)


class KVAware(RoutingPolicy):
    """The healthy instance where the request finishes soonest, from each instance's real prefix cache
    (:class:`~goodserve.kv_events.index.KVIndex`, fed by its KV events) and its load, priced in seconds by
    the step-time model the instances publish (:meth:`pooled_coefficients`): its time to first token there
    (:func:`predicted_ttft_s`: the queued prefill, the prompt tokens the instance does not hold, its decode
    rows) plus its decode there (:func:`predicted_decode_s`: its output beside the instance's decode rows
    and resident context, which is what a crowded instance lengthens every TPOT by). A cache hit wins while the prefill it saves outweighs that instance's
    longer queue, and loses once it does not: the trade NVIDIA Dynamo's KV router scores (prefill blocks
    still to compute plus decode load), here in seconds rather than a tuned ratio.

    When no instance holds at least ``min_match_tokens`` of the prompt, hits are ignored and the request
    goes to the least-loaded instance (a shared system header of a few tokens should not steer traffic:
    SGLang's cache threshold). Predictions within 0.1% of the best are ties, which go to the longer hit,
    then fewer outstanding tokens, then the index.
    After a choice the request's blocks are recorded as pending on the chosen instance
    (:meth:`KVIndex.expect`), so a burst sharing a prefix follows the first request before its events arrive.

    A prompt without token ids (text, when the router has no tokenizer) cannot be hashed as the engine does,
    and backends that publish no events have no index: then (either) the request is routed by
    :class:`PrefixAffinity`'s guessing index instead.

    Args:
        index: The instances' cache views, keyed by backend name.
        coefficients: Step-time coefficients while no instance has published any.
        token_budget: Tokens per step for an instance that has published none.
        min_match_tokens: Hits shorter than this on every instance are ignored (tokens).
        clock: Seconds now, for pending entries (the simulator passes its own clock).

    Raises:
        ValueError: if ``min_match_tokens < 0`` or ``token_budget < 1``.
    """

    name = "kv-aware"

    def __init__(self, index: Optional[KVIndex] = None, coefficients: StepCoefficients = DEFAULT_SEED,
                 token_budget: int = 1024, min_match_tokens: int = 32,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min_match_tokens < 0 or token_budget < 1:
            raise ValueError("min_match_tokens must be >= 0 and token_budget >= 1")
        self.index = index if index is not None else KVIndex()
        self.coefficients, self.token_budget, self.min_match_tokens = coefficients, token_budget, min_match_tokens
        self.clock = clock
        self._guess = PrefixAffinity()
        self._last: tuple[Optional[RouteRequest], dict[str, int]] = (None, {})  # request -> {name: uncached}

    def pooled_coefficients(self, backends: Sequence[BackendState], healthy: Sequence[int]) -> StepCoefficients:
        """The mean of the step-time coefficients the healthy backends published (``coefficients`` if none
        did). Replicas behind one router run the same model on the same hardware, so one model prices them
        all: each instance's online fit is noisy early on, and a noisier fit must not pass for a faster
        machine; what differs between them is their queues."""
        published = [load.step_coefficients for i in healthy
                     if (load := self._load(backends[i].name)) is not None and load.step_coefficients]
        if not published:
            return self.coefficients
        return StepCoefficients(*(sum(c[k] for c in published) / len(published) for k in range(len(published[0]))))

    def _load(self, name: str) -> Optional[InstanceLoad]:
        view = self.index.instances.get(name)
        return view.load if view is not None else None

    def _priced(self, b: BackendState, coeffs: StepCoefficients, request: RouteRequest, cached: int) -> float:
        load = self._load(b.name)
        budget = load.token_budget if load is not None and load.token_budget else self.token_budget
        ttft = predicted_ttft_s(coeffs, b.queued_prefill_tokens, b.queued_prefill_requests,
                                request.prompt_tokens - cached, cached, b.decoding_requests, budget)
        return ttft + predicted_decode_s(coeffs, request.max_tokens, b.decoding_requests,
                                         b.outstanding_tokens + request.total_tokens)

    def select(self, backends: Sequence[BackendState], request: RouteRequest) -> int:
        healthy = _healthy(backends)
        if request.token_ids is None or not any(self.index.publishes(backends[i].name) for i in healthy):
            return self._guess.select(backends, request)
        now, ids = self.clock(), request.token_ids
        hashes, hits, by_size = {}, {}, {}
        for i in healthy:
            name = backends[i].name
            size = self.index.block_size(name)
            if size not in by_size:
                by_size[size] = self.index.block_hashes(name, ids, request.cache_salt)
            hashes[i] = by_size[size]
            # The engine computes at least the prompt's last token, whatever it holds.
            hits[i] = min(self.index.match(name, hashes[i], now) * size, max(0, request.prompt_tokens - 1))
        if max(hits.values()) < self.min_match_tokens:
            hits = dict.fromkeys(hits, 0)
        coeffs = self.pooled_coefficients(backends, healthy)
        cost = {i: self._priced(backends[i], coeffs, request, hits[i]) for i in healthy}
        best = min(cost.values())
        near = [i for i in healthy if cost[i] <= best * (1 + TIE_RTOL) + TIE_ATOL_S]  # fitted noise is no reason
        chosen = min(near, key=lambda i: (-hits[i], cost[i], backends[i].outstanding_tokens, i))
        self.index.expect(backends[chosen].name, hashes[chosen], now)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kv-aware: %d prompt tokens to %s; per backend: hit tokens, queued prefill, decoding, "
                         "predicted s: %s", request.prompt_tokens, backends[chosen].name,
                         {backends[i].name: (hits[i], backends[i].queued_prefill_tokens,
                                             backends[i].decoding_requests, round(cost[i], 4)) for i in healthy})
        self._last = (request, {backends[i].name: request.prompt_tokens - hits[i] for i in healthy})
        return chosen

    def prefill_tokens(self, backend: BackendState, request: RouteRequest) -> int:
        last, uncached = self._last
        if last is request and backend.name in uncached:
            return uncached[backend.name]
        return request.prompt_tokens


POLICIES = {"round-robin": RoundRobin, "least-outstanding-tokens": LeastLoaded, "prefix-affinity": PrefixAffinity,
            "kv-aware": KVAware}


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A policy by its CLI name (``POLICIES``), with its constructor's keyword arguments.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
