"""KV cache events: what an instance's prefix cache stored and removed, published for routers."""
