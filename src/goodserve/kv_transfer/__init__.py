"""Prefill/decode disaggregation: KV blocks handed from one engine instance to another (DistServe, Zhong et
al., OSDI 2024).

A *producer* instance prefills a prompt, samples its first token, keeps the request's KV blocks and
publishes a handle (:class:`KVTransferParams`); a *consumer* instance given that handle allocates blocks,
pulls the producer's K/V for every layer into them and decodes. vLLM calls the piece that moves the bytes a
KV connector; so do we.

* :mod:`.params` and :mod:`.config`: the handle and the instance's settings, plain data (torch-free, the
  scheduler reads them).
* :mod:`.messages`: what the scheduler tells the connector each step (:class:`KVLoadSpec`) and what the
  connector reports back (:class:`KVConnectorOutput`), plain data.
* :mod:`.nixl_connector`: the connector, on NIXL (UCX underneath: TCP or shared memory between processes on
  one host, RDMA between GPUs where present). Small control messages (the producer's memory layout) go over
  a pyzmq side channel.
"""

from goodserve.kv_transfer.config import KV_ROLES, KVTransferConfig
from goodserve.kv_transfer.messages import KVConnectorOutput, KVLoadSpec
from goodserve.kv_transfer.params import KVTransferParams

__all__ = ["KV_ROLES", "KVTransferConfig", "KVConnectorOutput", "KVLoadSpec", "KVTransferParams"]
