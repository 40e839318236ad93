"""Speculative decoding: proposers of draft tokens, the speculation length chosen for goodput, and the
acceptance statistics (docs/speculation.md). Torch-free but for the draft-model proposer, which the model
runner builds."""
