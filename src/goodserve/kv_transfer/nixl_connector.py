"""The KV connector on NIXL: pulls a producer's K/V blocks into a consumer's cache, layer by layer.

Transport choice: NIXL (NVIDIA's inference transfer library, ``nixl-cu12`` on PyPI) moves registered
memory between agents over UCX: TCP or shared memory between processes on one host, RDMA (GPU memory
included) between hosts that have it. The consumer *reads* (one-sided): the producer only registers its KV
tensors once and never copies. A READ carries a notification to the producer on completion, which releases
its hold. The small control message a consumer needs once per producer (NIXL agent metadata and the
addresses and strides of its KV tensors) goes over a pyzmq REQ/REP side channel, asked without blocking the
engine loop.

Bytes moved: for tokens ``[start, end)`` of a request, per layer, K and V each, the filled slots of each
block: exactly ``2 · L · n_kv · d_head · b_dtype · (end - start)`` bytes.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from goodserve.kv_transfer.config import KVTransferConfig
from goodserve.kv_transfer.messages import KVConnectorOutput, KVLoadSpec

logger = logging.getLogger(__name__)

#: Seconds between two progress calls of the connector's thread.
PROGRESS_INTERVAL = 0.005


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
                    "with the same --dtype and --block-size on both")
        return None


@dataclass
class _Load:
    spec: KVLoadSpec
    started: float
    deadline: float
    nbytes: int = 0
    handle: Optional[object] = None  # the NIXL transfer, once the producer's layout is known


class NixlConnector:
    """Both sides of the KV hand-off for one engine instance.

    Args:
        config: The instance's settings (``port`` 0: a free one is picked; see :attr:`port`).
        kv_caches: The runner's cache, per layer ``(K, V)``, each ``[num_blocks, block_size, n_kv, head_dim]``
            and contiguous, on CPU.

    Raises:
        ImportError: if NIXL or pyzmq is not installed.
        ValueError: if the cache is not on CPU or not contiguous.
    """

    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
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
        tensors = [t for kv in kv_caches for t in kv]
        self._reg = self.agent.register_memory(self.agent.get_reg_descs(tensors))
        k0 = kv_caches[0][0]
        self.layout = _Layout(config.engine_id, [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches],
                              k0.stride(0) * k0.element_size(), k0.stride(1) * k0.element_size(), k0.shape[1],
                              str(k0.dtype))
        self._zmq = zmq.Context()
        self._rep = self._zmq.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{config.host}"
        self.port = self._rep.bind_to_random_port(address) if config.port == 0 else config.port
        if config.port:
            self._rep.bind(f"{address}:{config.port}")
        self._reply = json.dumps({"layout": {**self.layout.__dict__},
                                  "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}).encode()
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve_layout, name="goodserve-kv-side-channel", daemon=True)
        self._server.start()
        self._notifs: list[bytes] = []  # released holds, collected by the progress thread
        self._notifs_lock = threading.Lock()
        self._progress = threading.Thread(target=self._progress_forever, name="goodserve-kv-progress", daemon=True)
        self._progress.start()
        self._remotes: dict[str, _Layout] = {}  # engine id -> layout, once its agent is added
        self._asking: dict[str, tuple[object, float, list[_Load]]] = {}  # engine id -> (REQ socket, deadline, loads)
        self._loads: dict[str, _Load] = {}  # request id -> a pull in flight
        self._out = KVConnectorOutput()
        logger.info("KV connector (NIXL) %s: role %s, side channel %s:%d", config.engine_id, config.role,
                    config.host, self.port)

    # ------------------------------------------------------------------------------------ side channel
    def _serve_layout(self) -> None:
        """Answer each request on the side channel with this instance's layout and agent metadata."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self._rep.recv()
                self._rep.send(self._reply)

    def _progress_forever(self) -> None:
        """Progress NIXL's transfers (both ends of a pull must, over TCP) and collect its notifications."""
        while not self._stop.wait(PROGRESS_INTERVAL):
            msgs = [m for ms in self.agent.get_new_notifs().values() for m in ms]
            if msgs:
                with self._notifs_lock:
                    self._notifs.extend(msgs)

    def _ask_layout(self, load: _Load) -> None:
        """Queue ``load`` behind a (non-blocking) request for its producer's layout."""
        import zmq

        r = load.spec.remote
        entry = self._asking.get(r.remote_engine_id)
        if entry is None:
            sock = self._zmq.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{r.remote_host}:{r.remote_port}")
            sock.send(b"layout")
            entry = (sock, load.deadline, [])
            self._asking[r.remote_engine_id] = entry
        entry[2].append(load)

    def _poll_layouts(self, now: float) -> None:
        """Take the producers' answers that arrived; fail the loads of those that did not answer in time."""
        import zmq

        for engine_id, (sock, deadline, loads) in list(self._asking.items()):
            if sock.poll(0, zmq.POLLIN):
                del self._asking[engine_id]
                reply = json.loads(sock.recv())
                sock.close()
                layout = _Layout(**reply["layout"])
                layout.bases = [tuple(b) for b in layout.bases]
                why = self.layout.compatible(layout)
                if why is None:
                    self.agent.add_remote_agent(base64.b64decode(reply["metadata"]))
                    self._remotes[engine_id] = layout
                for load in loads:
                    if why:
                        self._fail(load, why)
                    else:
                        self._transfer(load, layout)
            elif now >= deadline:
                del self._asking[engine_id]
                sock.close()
                for load in loads:
                    r = load.spec.remote
                    self._fail(load, f"the producer {engine_id} at {r.remote_host}:{r.remote_port} did not answer "
                                     f"within {self.config.timeout:g} s (is it running?)")

    # ----------------------------------------------------------------------------------------- pulls
    def start_loads(self, specs: list[KVLoadSpec]) -> None:
        """Start pulling each spec's tokens (the results come from :meth:`poll`, exactly one per spec)."""
        now = time.monotonic()
        for spec in specs:
            load = _Load(spec, now, now + self.config.timeout)
            self._loads[spec.request_id] = load
            layout = self._remotes.get(spec.remote.remote_engine_id)
            if layout is None:
                self._ask_layout(load)
            else:
                self._transfer(load, layout)

    def _transfer(self, load: _Load, remote: _Layout) -> None:
        """Post the READ of ``load``'s tokens from ``remote``; it notifies the producer when done."""
        spec, r = load.spec, load.spec.remote
        notif = r.remote_request_id.encode()
        try:
            if spec.end <= spec.start:  # every token was a local prefix hit: only release the producer's hold
                self.agent.send_notif(remote.agent_name, notif)
                self._done(load)
                return
            local = self.layout.descs(spec.block_ids, spec.start, spec.end)
            remote_descs = remote.descs(list(r.remote_block_ids), spec.start, spec.end)
            load.nbytes = int(local[:, 1].sum())
            load.handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                     self.agent.get_xfer_descs(remote_descs, "DRAM"),
                                                     remote.agent_name, notif)
            if self.agent.transfer(load.handle) == "ERR":
                self._fail(load, "NIXL refused the transfer")
        except Exception as e:  # noqa: BLE001 - this request fails; the engine serves on
            self._fail(load, f"{type(e).__name__}: {e}")

    def _release(self, load: _Load) -> None:
        self._loads.pop(load.spec.request_id, None)
        if load.handle is not None:
            try:
                self.agent.release_xfer_handle(load.handle)
            except Exception:  # noqa: BLE001 - an aborted transfer may refuse; nothing more can be done
                logger.debug("releasing the transfer of %s failed", load.spec.request_id, exc_info=True)
            load.handle = None

    def _done(self, load: _Load) -> None:
        self._release(load)
        self._out.finished_recving[load.spec.request_id] = (load.nbytes, time.monotonic() - load.started)

    def _fail(self, load: _Load, why: str) -> None:
        self._release(load)
        r = load.spec.remote
        self._out.failed_recving[load.spec.request_id] = (
            f"pulling the prompt's KV cache from producer {r.remote_engine_id} ({r.remote_host}:{r.remote_port}) "
            f"failed: {why}")

    def poll(self) -> KVConnectorOutput:
        """Advance the pulls and collect the news since the last call (pulls done or failed; holds that
        consumers released)."""
        now = time.monotonic()
        if self._asking:
            self._poll_layouts(now)
        for load in list(self._loads.values()):
            if load.handle is None:
                continue
            state = self.agent.check_xfer_state(load.handle)
            if state == "DONE":
                self._done(load)
            elif state == "ERR":
                self._fail(load, "the transfer failed (the producer may be gone)")
            elif now >= load.deadline:
                self._fail(load, f"the transfer did not finish within {self.config.timeout:g} s")
        with self._notifs_lock:
            msgs, self._notifs = self._notifs, []
        self._out.finished_sending.extend(m.decode() for m in msgs)
        out, self._out = self._out, KVConnectorOutput()
        return out

    def close(self) -> None:
        """Stop the side channel and release NIXL resources."""
        self._stop.set()
        self._server.join(1.0)
        self._progress.join(1.0)
        for load in list(self._loads.values()):
            self._release(load)
        for sock, _, _ in self._asking.values():
            sock.close()
        self._rep.close()
        self._zmq.term()
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("deregistering the KV cache failed", exc_info=True)
