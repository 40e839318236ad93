"""Prefill/decode disaggregation: KV blocks handed from one engine instance to another (DistServe, Zhong et
al., OSDI 2024).

A *producer* instance prefills a prompt, samples its first token, keeps the request's KV blocks under a
lease and publishes a handle (:class:`KVTransferParams`); a *consumer* instance given that handle allocates
blocks, claims the lease, pulls the producer's K/V for every layer into them, releases it and decodes. vLLM
calls the piece that moves the bytes a KV connector; so do we.

* :mod:`.params` and :mod:`.config`: the handle and the instance's settings, plain data.
* :mod:`.messages`: what the scheduler tells the connector each step (:class:`KVLoadSpec`) and what the
  connector reports back (:class:`KVConnectorOutput`), plain data.
* :mod:`.base`: the connector's two halves, the only way the scheduler and the engine core use it;
  :mod:`.factory` builds them from the config.
* :mod:`.pull_scheduler` (the scheduler half: holds, pulls, expiry) and :mod:`.lease` (the producer's
  leases), torch-free, so the simulator runs them too.
* :mod:`.side_channel`: claim and release of a lease over pyzmq; :mod:`.nixl_connector`: the worker half on
  NIXL (UCX underneath: TCP or shared memory between processes on one host, RDMA between GPUs where present).
"""

from goodserve.kv_transfer.config import KV_ROLES, KVTransferConfig
from goodserve.kv_transfer.messages import KVConnectorOutput, KVLoadSpec
from goodserve.kv_transfer.params import KVTransferParams

__all__ = ["KV_ROLES", "KVTransferConfig", "KVConnectorOutput", "KVLoadSpec", "KVTransferParams"]
