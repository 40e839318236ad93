"""Routing across servers: torch-free policies (:mod:`.policies`, shared with the simulator), the P/D hop
bodies (:mod:`.protocol`) and the OpenAI-compatible HTTP router (:mod:`.app`, ``goodserve router``)."""
