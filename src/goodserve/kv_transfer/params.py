"""The per-request ``kv_transfer_params`` of disaggregated serving, as vLLM's disaggregated proxy names them.

A request sent to a producer carries ``{"do_remote_decode": true}``; the producer's answer carries the
handle a consumer needs (``do_remote_prefill`` and the ``remote_*`` fields), which the router passes on to
a consumer with the same request. ``remote_lease`` is ours (not vLLM's): the nonce of the producer's hold
(:mod:`goodserve.kv_transfer.lease`), without which the producer refuses the pull.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from goodserve.validation import ParamError

_FIELDS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
           "remote_block_ids", "remote_request_id", "remote_num_tokens", "remote_lease")


@dataclass(frozen=True)
class KVTransferParams:
    """One request's part in a KV hand-off.

    Attributes:
        do_remote_decode: Producer side: after the prefill, keep the request's blocks for a consumer to pull
            and answer with a handle.
        do_remote_prefill: Consumer side: the prompt's K/V is to be pulled from the producer named below.
        remote_engine_id: The producer instance's id (also its NIXL agent name).
        remote_host: The producer's side-channel host (its memory layout is asked for there).
        remote_port: The producer's side-channel TCP port.
        remote_block_ids: The producer's block table of the request, first token's block first.
        remote_request_id: The request's id on the producer (its blocks are released under it).
        remote_num_tokens: Prompt tokens whose K/V the producer holds (the consumer's prompt must have as many).
        remote_lease: The hold's nonce: the producer validates every pull (and release) against it.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Optional[str] = None
    remote_host: Optional[str] = None
    remote_port: Optional[int] = None
    remote_block_ids: Optional[tuple[int, ...]] = None
    remote_request_id: Optional[str] = None
    remote_num_tokens: Optional[int] = None
    remote_lease: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Any) -> "KVTransferParams":
        """Parse and check a request body's ``kv_transfer_params``.

        Raises:
            ParamError: (``param="kv_transfer_params"``) on a non-object, an unknown field, a field of the
                wrong type, both or neither of ``do_remote_decode`` / ``do_remote_prefill``, or a
                ``do_remote_prefill`` handle missing one of its ``remote_*`` fields.
        """
        def bad(msg: str) -> ParamError:
            return ParamError(f"kv_transfer_params: {msg}", param="kv_transfer_params")

        if not isinstance(d, dict):
            raise bad(f"must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS) - {"tp_size", "remote_tp_size"})  # vLLM's, always 1 here
        if unknown:
            raise bad(f"unknown field(s) {unknown}; known: {list(_FIELDS)}")
        for f in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(d.get(f, False), bool):
                raise bad(f"{f} must be a boolean")
        decode, prefill = d.get("do_remote_decode", False), d.get("do_remote_prefill", False)
        if decode == prefill:
            raise bad("exactly one of do_remote_decode (send to a producer) and do_remote_prefill (send to a "
                      "consumer, with the producer's handle) must be true")
        if decode:
            return cls(do_remote_decode=True)
        missing = [f for f in _FIELDS[2:] if d.get(f) is None]
        if missing:
            raise bad(f"do_remote_prefill needs the producer's handle; missing {missing}")
        ints = {"remote_port": d["remote_port"], "remote_num_tokens": d["remote_num_tokens"]}
        for f, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{f} must be a positive integer, got {v!r}")
        ids = d["remote_block_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise bad("remote_block_ids must be a list of block ids (integers >= 0)")
        for f in ("remote_engine_id", "remote_host", "remote_request_id", "remote_lease"):
            if not isinstance(d[f], str) or not d[f] or len(d[f]) > 256:
                raise bad(f"{f} must be a non-empty string (at most 256 characters)")
        return cls(do_remote_prefill=True, remote_engine_id=d["remote_engine_id"], remote_host=d["remote_host"],
                   remote_port=d["remote_port"], remote_block_ids=tuple(ids),
                   remote_request_id=d["remote_request_id"], remote_num_tokens=d["remote_num_tokens"],
                   remote_lease=d["remote_lease"])

    def to_dict(self) -> dict:
        """The JSON form (``remote_block_ids`` as a list)."""
        d = asdict(self)
        if d["remote_block_ids"] is not None:
            d["remote_block_ids"] = list(d["remote_block_ids"])
        return d
