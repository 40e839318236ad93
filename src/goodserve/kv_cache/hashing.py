"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its own token ids *and* its parent's hash, so equal hashes mean equal whole
prefixes, not just equal blocks: block ``i`` of two requests can share K/V only if tokens
``[0, (i + 1) * block_size)`` are identical (the K/V of a token depends on every token before it).
Extra keys (the request's ``cache_salt``) enter every block's hash, so requests with different salts
never share a block even for the same tokens.

Hashes are SHA-256 digests of a pickle (fixed protocol) of plain ints, tuples, strings and bytes: stable
across processes and Python runs, unlike the built-in ``hash()`` (salted per process for ``str``).
Source: the block-level sharing of PagedAttention (Kwon et al., SOSP 2023, §4.4) made content-addressed.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, NewType, Optional, Sequence

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 digest identifying a full block together with its whole prefix."""

_PICKLE_PROTOCOL = 4  # pinned so digests do not change with the interpreter's default protocol


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int],
                      extra_keys: Optional[tuple[Any, ...]] = None) -> BlockHash:
    """Hash one full block.

    Args:
        parent_hash: Hash of the previous block of the same sequence, ``None`` for the first block.
        token_ids: The block's ``block_size`` token ids.
        extra_keys: Anything else that changes the K/V or must isolate tenants (e.g. ``(cache_salt,)``);
            must hold only picklable builtins (int, str, bytes, tuples, ``None``).

    Returns:
        The block's :data:`BlockHash`.
    """
    payload = (parent_hash, tuple(int(t) for t in token_ids), extra_keys)
    return BlockHash(hashlib.sha256(pickle.dumps(payload, protocol=_PICKLE_PROTOCOL)).digest())


def hash_request_blocks(token_ids: Sequence[int], block_size: int,
                        extra_keys: Optional[tuple[Any, ...]] = None,
                        known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block is not hashed).

    Args:
        token_ids: A sequence's tokens (prompt and outputs so far).
        block_size: Tokens per block.
        extra_keys: Keys mixed into every block's hash (see :func:`hash_block_tokens`).
        known: Hashes already computed for the first blocks of this same sequence; they are reused and
            only the following full blocks are hashed (token lists only grow, so a prefix stays valid).

    Returns:
        ``len(token_ids) // block_size`` hashes, block 0 first.
    """
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of KV-cache group ``group``'s block of ``block_hash``: the hash itself for group 0 (so a
    one-group cache and its KV events keep plain block hashes), else the hash followed by the group's index (each
    group holds its own K/V for the same tokens, in its own block)."""
    return block_hash if group == 0 else BlockHash(block_hash + group.to_bytes(2, "little"))


def is_block_hash(key: bytes) -> bool:
    """Whether a prefix-cache key is a plain block hash (group 0's key), not another group's :func:`group_key`."""
    return len(key) == hashlib.sha256().digest_size
