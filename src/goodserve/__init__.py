"""goodserve: an LLM serving engine built for goodput."""
