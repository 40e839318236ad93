"""What the simulator simulates: the workload's requests (:class:`SimRequest`) and the cluster
(:class:`ClusterConfig`: instances, their scheduler and KV pool, routing, an optional prefill/decode split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.spec.config import SpeculativeConfig

# The router's policies (goodserve.router.policies); "least-loaded" is the old name of least-outstanding-tokens.
ROUTING_POLICIES = ("round-robin", "least-outstanding-tokens", "prefix-affinity", "kv-aware", "least-loaded")
ROUTING_ALIASES = {"least-loaded": "least-outstanding-tokens"}


@dataclass(frozen=True)
class SimRequest:
    """One request of the simulated workload.

    Attributes:
        request_id: Unique id.
        arrival: When the client sends it, seconds from the start.
        prompt_len: Prompt tokens.
        output_len: Output tokens it generates: the simulated model samples EOS as token ``output_len``.
        max_tokens: The cap the client asks for (``None``: exactly ``output_len``). Only a scheduler that
            reserves memory by it (``reserve``) behaves differently with a larger cap.
        slo_ttft: Its own TTFT SLO in seconds (``None``: the simulation's ``ttft`` SLO, if any).
        slo_tpot: Its own TPOT SLO in seconds (``None``: the simulation's ``tpot`` SLO, if any).
        prompt_token_ids: The prompt's token ids (``prompt_len`` of them, each >= 256), e.g. a trace's shared
            prefixes synthesised by :func:`goodserve.workload.datasets.synthesise_shared_prompts`; ``None``:
            ids private to the request, so no two prompts share a prefix.
    """

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    max_tokens: Optional[int] = None
    slo_ttft: Optional[float] = None
    slo_tpot: Optional[float] = None
    prompt_token_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"{self.request_id}: prompt and output need >= 1 token")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"{self.request_id}: {len(self.prompt_token_ids)} prompt_token_ids for prompt_len "
                             f"{self.prompt_len}")
        if self.max_tokens is not None and self.max_tokens < self.output_len:
            raise ValueError(f"{self.request_id}: max_tokens {self.max_tokens} < output_len {self.output_len}")

    @property
    def cap(self) -> int:
        """``max_tokens`` as resolved: ``output_len`` when not given."""
        return self.output_len if self.max_tokens is None else self.max_tokens


@dataclass(frozen=True)
class Disaggregation:
    """Separate prefill and decode instances joined by a link.

    Attributes:
        num_prefill: Prefill instances.
        num_decode: Decode instances.
        link_bandwidth: Bytes per second of each prefill instance's outgoing link.
        kv_bytes_per_token: KV bytes one prompt token occupies (all layers).
    """

    num_prefill: int
    num_decode: int
    link_bandwidth: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"disaggregation needs >= 1 prefill and >= 1 decode instance, got "
                             f"{self.num_prefill}:{self.num_decode}")
        if self.link_bandwidth <= 0:
            raise ValueError(f"link bandwidth must be > 0, got {self.link_bandwidth}")

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to move ``num_tokens`` tokens of KV over one link."""
        return num_tokens * self.kv_bytes_per_token / self.link_bandwidth


@dataclass(frozen=True)
class ClusterConfig:
    """What is simulated: the instances, their scheduler and KV pool, and the routing.

    Attributes:
        scheduler: Every instance's scheduler limits and mode.
        cache: Every instance's KV pool (``num_blocks`` resolved).
        enable_prefix_caching: Prefix caching on colocated and prefill instances.
        num_replicas: Independent colocated instances (ignored when disaggregated).
        routing: The replicas' policy, a :data:`goodserve.router.policies.POLICIES` name: ``"round-robin"``,
            ``"least-outstanding-tokens"`` (also ``"least-loaded"``) or ``"prefix-affinity"`` (default block
            size 16 tokens).
        disaggregation: Prefill/decode split, or ``None`` for colocated replicas.
        speculative: Speculative decoding on every instance that decodes (``None``: none); the simulated
            proposer always has drafts, each accepted with ``spec_acceptance``.
        spec_acceptance: The conditional acceptance rate of a draft at each position (the last one repeats),
            e.g. measured on a real server: ``spec_decode_num_accepted_tokens_per_pos`` over the drafts that
            reached each position.
    """

    scheduler: SchedulerConfig
    cache: CacheConfig
    enable_prefix_caching: bool = True
    num_replicas: int = 1
    routing: str = "least-outstanding-tokens"
    disaggregation: Optional[Disaggregation] = None
    speculative: Optional[SpeculativeConfig] = None
    spec_acceptance: tuple[float, ...] = (0.7,)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not self.spec_acceptance or not all(0.0 <= a <= 1.0 for a in self.spec_acceptance):
            raise ValueError(f"spec_acceptance must be rates in [0, 1], got {self.spec_acceptance!r}")

    @property
    def num_instances(self) -> int:
        d = self.disaggregation
        return d.num_prefill + d.num_decode if d else self.num_replicas
