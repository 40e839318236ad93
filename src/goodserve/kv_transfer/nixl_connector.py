"""The KV connector's worker half on NIXL: pulls a producer's K/V blocks into a consumer's cache, layer by
layer.

Transport choice: NIXL (NVIDIA's inference transfer library, ``nixl-cu12`` on PyPI) moves registered
memory between agents over UCX: TCP or shared memory between processes on one host, RDMA (GPU memory
included) between hosts that have it. The consumer *reads* (one-sided): the producer only registers its KV
tensors once and never copies. Because a one-sided read cannot be refused, every pull is bracketed by a
*claim* and a *release* of the producer's lease over a pyzmq REQ/REP side channel
(:mod:`goodserve.kv_transfer.side_channel`); the first claim to a producer also brings its NIXL agent
metadata and the addresses and strides of its KV tensors.

Bytes moved: for tokens ``[start, end)`` of a request, per layer, K and V each, the filled slots of each
block: exactly ``2 · L · n_kv · row · (end - start)`` bytes, ``row`` being a K/V row's bytes
(:func:`goodserve.kv_cache.spec.kv_row_bytes`: ``d_head · b_dtype``, or ``d_head + 4`` for an int8 cache,
whose rows carry their float32 scale, :mod:`goodserve.models.kv_quant`).

A READ given up while it runs (past its deadline, or aborted and past it) cannot be recalled: NIXL's
``release_xfer_handle`` on an active transfer only *attempts* a cancel (its UCX backend cancels the requests
and reports success even where, by its own comment, that "may not be enough"). So the connector never
releases an active READ: it reports the pull failed at once and ``still_writing``, keeps the handle, and
reports ``done_writing`` once NIXL's state for it is ``DONE`` or ``ERR``; only then does the scheduler
half free the blocks. :meth:`NixlConnector.close` likewise keeps the registration and the KV tensors until every
READ has ended.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from goodserve.kv_transfer.base import KVConnectorWorker
from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.lease import LeaseTable
from goodserve.kv_transfer.messages import KVConnectorOutput, KVLoadSpec
from goodserve.kv_transfer.side_channel import SideChannelClient, SideChannelServer

logger = logging.getLogger(__name__)

#: Seconds between two progress calls of the connector's thread.
PROGRESS_INTERVAL = 0.005
#: Seconds :meth:`NixlConnector.close` waits for running READs before it leaves them to the progress thread.
CLOSE_WAIT_S = 2.0


def _import_nixl():
    """NIXL's agent classes (``nixl`` or ``nixl_cu12``).

    Raises:
        ImportError: naming the package to install.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # type: ignore
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # type: ignore
        except ImportError as e:
            raise ImportError("disaggregated serving needs NIXL: pip install nixl-cu12 pyzmq "
                              "(scripts/setup.sh installs them)") from e
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


@dataclass
class _Layout:
    """Where an instance's KV tensors are: per layer ``(K address, V address)``, and their strides (bytes)."""

    agent_name: str
    bases: list[tuple[int, int]]
    block_bytes: int
    token_bytes: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, agent_name: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> "_Layout":
        """The layout of contiguous per-layer caches ``[num_blocks, block_size, n_kv, row]`` of any dtype
        (an int8 cache's ``row`` includes its scale bytes): strides in bytes, the dtype by name."""
        k0 = kv_caches[0][0]
        return cls(agent_name, [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches],
                   k0.stride(0) * k0.element_size(), k0.stride(1) * k0.element_size(), k0.shape[1], str(k0.dtype))

    def descs(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        """NIXL descriptors ``[n, 3]`` (address, length, device id) of tokens ``[start, end)`` held in
        ``block_ids`` (the request's table), per layer, K then V. ``start`` must be block-aligned."""
        bs = self.block_size
        rows = []
        for j in range(start // bs, -(-end // bs)):
            ntok = min(end, (j + 1) * bs) - j * bs
            off = block_ids[j] * self.block_bytes
            for k, v in self.bases:
                rows.append((k + off, ntok * self.token_bytes, 0))
                rows.append((v + off, ntok * self.token_bytes, 0))
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)

    def compatible(self, other: "_Layout") -> Optional[str]:
        """Why a pull between the two layouts is impossible, or ``None``."""
        if (len(self.bases), self.token_bytes, self.block_size, self.dtype) != \
                (len(other.bases), other.token_bytes, other.block_size, other.dtype):
            return (f"KV layouts differ (layers, bytes per token, block size, dtype): producer "
                    f"{(len(other.bases), other.token_bytes, other.block_size, other.dtype)}, consumer "
                    f"{(len(self.bases), self.token_bytes, self.block_size, self.dtype)}; serve the same model "
                    "with the same --dtype, --kv-cache-dtype and --block-size on both")
        return None


@dataclass
class _Load:
    spec: KVLoadSpec
    started: float
    deadline: float  # the consumer's timeout, then (once claimed) also the end of the producer's pin
    nbytes: int = 0
    claimed: bool = False
    cancelled: bool = False  # the request was aborted: give the pull up once nothing writes into its blocks
    handle: Optional[object] = None  # the NIXL READ, once posted


class NixlConnector(KVConnectorWorker):
    """The worker half of one engine instance's KV hand-off, on NIXL.

    Args:
        config: The instance's settings (``port`` 0: a free one is picked; see :attr:`port`).
        kv_caches: The runner's cache, per layer ``(K, V)``, each ``[num_blocks, block_size, n_kv, head_dim]``
            (int8: ``head_dim + 4``) and contiguous, on CPU.
        leases: The producer's lease table (shared with the scheduler half), which the side channel checks
            every claim and release against; ``None`` on a consumer-only instance.

    Raises:
        ImportError: if NIXL or pyzmq is not installed.
        ValueError: if the cache is not on CPU or not contiguous.
    """

    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 leases: Optional[LeaseTable] = None) -> None:
        import zmq

        if any(t.device.type != "cpu" or not t.is_contiguous() for kv in kv_caches for t in kv):
            raise ValueError("the NIXL connector registers contiguous CPU KV tensors (DRAM); VRAM is not wired yet")
        os.environ.setdefault("UCX_NET_DEVICES", config.ucx_net_devices)
        nixl_agent, nixl_agent_config, nixl_thread_sync_t = _import_nixl()
        self.config = config
        # NIXL's own progress thread busy-polls a whole core; ours polls every PROGRESS_INTERVAL seconds, so
        # transfers move while the engine runs a long step (over TCP both sides must progress). The agent is
        # then called from two threads: strict thread synchronisation.
        self.agent = nixl_agent(config.engine_id, nixl_agent_config(
            enable_prog_thread=False, backends=list(config.backends), sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        # Held while registered: a READ still running at close keeps the memory it writes alive.
        self._tensors = [t for kv in kv_caches for t in kv]
        self._reg = self.agent.register_memory(self.agent.get_reg_descs(self._tensors))
        self.layout = _Layout.of(config.engine_id, kv_caches)
        self._zmq = zmq.Context()
        layout = {"layout": {**self.layout.__dict__},
                  "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}
        self._server = SideChannelServer(self._zmq, config.host, config.port, config.engine_id, leases, layout)
        self.port = self._server.port
        self._client = SideChannelClient(self._zmq)
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_forever, name="goodserve-kv-progress", daemon=True)
        self._progress.start()
        self._remotes: dict[str, _Layout] = {}  # engine id -> layout, once its agent is added
        self._loads: dict[str, _Load] = {}  # request id -> a pull not yet reported
        self._writing: dict[str, _Load] = {}  # request id -> a pull reported failed whose READ has not ended
        self._orphans: Optional[list[_Load]] = None  # READs still running at close, for the progress thread
        self._out = KVConnectorOutput()
        logger.info("KV connector (NIXL) %s: role %s, side channel %s:%d", config.engine_id, config.role,
                    config.host, self.port)

    def _progress_forever(self) -> None:
        """Progress NIXL's transfers: over TCP both ends of a READ must, the producer's included. After a
        :meth:`close` that left READs running, wait for them, then deregister the memory and stop."""
        while not self._stop.wait(PROGRESS_INTERVAL):
            self.agent.get_new_notifs()
            orphans = self._orphans
            if orphans is not None:
                orphans[:] = [load for load in orphans if not self._ended(load)]
                if not orphans:
                    logger.info("KV connector %s: the last READ ended after close; its memory is deregistered",
                                self.config.engine_id)
                    self._deregister()
                    return

    # ----------------------------------------------------------------------------------------- pulls
    def start_loads(self, specs: list[KVLoadSpec]) -> None:
        """Claim each spec's hold on its producer (the READ follows the claim's answer); one result per spec
        comes from :meth:`poll`."""
        now = time.monotonic()
        for spec in specs:
            load = _Load(spec, now, now + self.config.timeout)
            self._loads[spec.request_id] = load
            if spec.end <= spec.start:  # every token was a local prefix hit: nothing to read
                self._release(load, "pulled")
                self._done(load)
                continue
            r = spec.remote
            self._client.send(r.remote_host, r.remote_port, {
                "op": "claim", "engine_id": r.remote_engine_id, "request_id": r.remote_request_id,
                "lease": r.remote_lease, "block_ids": list(r.remote_block_ids),
                "layout": r.remote_engine_id not in self._remotes}, load.deadline, ("claim", spec.request_id, now))

    def cancel_loads(self, request_ids: list[str]) -> None:
        """Give up the pulls of aborted requests: one waiting for its claim is released when the answer
        comes, one reading when the READ ends (it may still write into the blocks until then)."""
        for rid in request_ids:
            load = self._loads.get(rid)
            if load is not None:
                load.cancelled = True

    def _claimed(self, load: _Load, reply: Optional[dict], sent: float) -> None:
        """The producer answered a claim (``None``: not within the timeout)."""
        r = load.spec.remote
        if reply is None:
            self._fail(load, f"the producer {r.remote_engine_id} at {r.remote_host}:{r.remote_port} did not "
                             f"answer within {self.config.timeout:g} s (is it running?)")
            return
        if not reply.get("ok"):
            self._fail(load, f"the producer refused the pull: {reply.get('error')}")
            return
        load.claimed = True
        load.deadline = min(load.deadline, sent + float(reply["pin_s"]))  # never read past the producer's pin
        if "layout" in reply and r.remote_engine_id not in self._remotes:
            layout = _Layout(**reply["layout"])
            layout.bases = [tuple(b) for b in layout.bases]
            why = self.layout.compatible(layout)
            if why:
                self._fail(load, why, "failed")
                return
            self.agent.add_remote_agent(base64.b64decode(reply["metadata"]))
            self._remotes[r.remote_engine_id] = layout
        remote = self._remotes.get(r.remote_engine_id)
        if remote is None:
            self._fail(load, "the producer's memory layout is unknown (an earlier claim found it incompatible)",
                       "failed")
        elif load.cancelled:
            self._fail(load, "aborted", "aborted")
        elif time.monotonic() >= load.deadline:
            self._fail(load, "the producer's claim answer came too late to read under its pin", "failed")
        else:
            self._transfer(load, remote)

    def _transfer(self, load: _Load, remote: _Layout) -> None:
        """Post the READ of ``load``'s tokens from ``remote`` (claimed: the producer pins them)."""
        spec, r = load.spec, load.spec.remote
        try:
            local = self.layout.descs(spec.block_ids, spec.start, spec.end)
            remote_descs = remote.descs(list(r.remote_block_ids), spec.start, spec.end)
            load.nbytes = int(local[:, 1].sum())
            load.handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                     self.agent.get_xfer_descs(remote_descs, "DRAM"),
                                                     remote.agent_name)
            if self.agent.transfer(load.handle) == "ERR":
                self._fail(load, "NIXL refused the transfer", "failed")
        except Exception as e:  # noqa: BLE001 - this request fails; the engine serves on
            self._fail(load, f"{type(e).__name__}: {e}", "failed")

    def _release(self, load: _Load, reason: str) -> None:
        """Tell the producer its hold can go (the answer is only logged)."""
        r = load.spec.remote
        self._client.send(r.remote_host, r.remote_port, {
            "op": "release", "engine_id": r.remote_engine_id, "request_id": r.remote_request_id,
            "lease": r.remote_lease, "reason": reason}, time.monotonic() + self.config.timeout,
            ("release", load.spec.request_id, 0.0))

    def _state(self, load: _Load) -> str:
        """NIXL's state of ``load``'s READ: ``"PROC"`` while it may write, ``"DONE"`` or ``"ERR"`` once ended
        (also when never posted, or when NIXL no longer knows the handle: it raises)."""
        if load.handle is None:
            return "DONE"
        try:
            return self.agent.check_xfer_state(load.handle)
        except Exception:  # noqa: BLE001 - NIXL reports an error for this transfer: it has ended
            logger.debug("checking the transfer of %s failed", load.spec.request_id, exc_info=True)
            return "ERR"

    def _ended(self, load: _Load) -> bool:
        """Whether ``load``'s READ has ended; if so its NIXL handle is released (never while it runs)."""
        if self._state(load) == "PROC":
            return False
        if load.handle is not None:
            try:
                self.agent.release_xfer_handle(load.handle)
            except Exception:  # noqa: BLE001 - the transfer has ended; only its bookkeeping stays in NIXL
                logger.debug("releasing the transfer of %s failed", load.spec.request_id, exc_info=True)
            load.handle = None
        return True

    def _done(self, load: _Load) -> None:
        self._loads.pop(load.spec.request_id, None)
        self._ended(load)
        self._out.finished_recving[load.spec.request_id] = (load.nbytes, time.monotonic() - load.started)

    def _fail(self, load: _Load, why: str, release: Optional[str] = None) -> None:
        """Report ``load`` failed at once; with ``release``, a claimed hold is released with that reason. A READ
        that may still write into the request's blocks is kept (``still_writing``) until it ends."""
        rid = load.spec.request_id
        self._loads.pop(rid, None)
        if not self._ended(load):
            self._writing[rid] = load
            self._out.still_writing.append(rid)
        if release is not None and load.claimed:
            self._release(load, release)
        r = load.spec.remote
        self._out.failed_recving[load.spec.request_id] = (
            f"pulling the prompt's KV cache from producer {r.remote_engine_id} ({r.remote_host}:{r.remote_port}) "
            f"failed: {why}")

    def poll(self) -> KVConnectorOutput:
        """Advance the claims and READs and collect the pulls that ended since the last call, and the
        given-up READs that have stopped writing."""
        for rid, load in list(self._writing.items()):
            if self._ended(load):
                del self._writing[rid]
                self._out.done_writing.append(rid)
        now = time.monotonic()
        for (kind, rid, sent), reply in self._client.poll(now):
            load = self._loads.get(rid)
            if kind == "claim" and load is not None:
                self._claimed(load, reply, sent)
            elif kind == "release" and not (reply or {}).get("ok"):
                logger.warning("KV transfer: the producer did not take the release of %s's hold: %s", rid,
                               (reply or {}).get("error", "no answer"))
        for load in list(self._loads.values()):
            if load.handle is None:
                continue
            state = self._state(load)
            if now >= load.deadline:  # past the pin, the producer may reuse the blocks: whatever landed is void
                self._fail(load, f"the transfer did not finish within {self.config.timeout:g} s",
                           "aborted" if load.cancelled else "failed")
            elif state == "DONE":
                if load.cancelled:
                    self._fail(load, "aborted", "aborted")
                else:
                    self._release(load, "pulled")
                    self._done(load)
            elif state == "ERR":
                self._fail(load, "the transfer failed (the producer may be gone)", "failed")
        out, self._out = self._out, KVConnectorOutput()
        return out

    def close(self) -> None:
        """Stop the side channel and release NIXL's resources, never under a running READ.

        READs still running (pulls in flight, or given up) are waited for up to :data:`CLOSE_WAIT_S`. Those
        that outlast it keep the agent, the registration and the KV tensors alive (the progress thread holds
        this connector): it deregisters the memory once the last of them ends, so freed memory is never
        written.
        """
        self._server.close()
        self._client.close()
        self._zmq.term()
        running = list(self._loads.values()) + list(self._writing.values())
        self._loads.clear()
        self._writing.clear()
        deadline = time.monotonic() + CLOSE_WAIT_S
        while True:
            running = [load for load in running if not self._ended(load)]
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(PROGRESS_INTERVAL)
        if running:
            logger.error("KV connector %s closed with %d READ(s) still writing into its KV cache; its memory "
                         "stays registered and allocated until they end", self.config.engine_id, len(running))
            self._orphans = running
            return
        self._stop.set()
        self._progress.join(1.0)
        self._deregister()

    def _deregister(self) -> None:
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("deregistering the KV cache failed", exc_info=True)
