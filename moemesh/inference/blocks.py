"""Who holds which block of the paged KV cache, and the prefix cache: blocks already computed,
found again by what they hold.

Blocks 1 .. num_blocks - 1 are handed out (block 0 is the cache's null block). A block is held by
a reference count: one per sequence whose block table names it. A *full* block of computed
entries gets a key, `block_key(key of the block before, its tokens)`, a hash of its tokens and
(through the chain) of every token before them: two sequences whose first n blocks of tokens are
equal have equal keys for those blocks, and only then (up to a 64-bit hash collision on the chain,
vLLM's and SGLang's assumption too; the block's own tokens are compared exactly). A new sequence
first takes the longest run of its prompt's full blocks that the pool has keyed (`match`) — the
keys and values of those tokens are already there — and computes only the rest.

A block whose count drops to 0 is free but keeps its key and contents: a later `match` takes it
back. Free blocks, keyed or not, wait in one queue in the order they were freed (a sequence's last
block first, so that its prefix outlives its tail); `allocate` takes the block free the longest
and drops its key: cached prefixes are evicted least recently used (vLLM's policy).

New weights (`DecodeEngine.load_weights`) make every cached block stale: its keys and values were
computed with the old ones. `reset_prefix_cache` drops every key; it refuses while a sequence
holds blocks, whose entries would be stale too.
"""

from __future__ import annotations

from collections import OrderedDict


def block_key(previous: int | None, tokens: list[int]) -> int:
    """The key of a full block of `tokens` after the block keyed `previous` (None: the first)."""
    return hash((previous, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # oldest first
        self.cached: dict[int, int] = {}  # key -> block
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, its tokens)
        self.hits = self.queries = 0  # prompt tokens found cached / looked up (for reports)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each held once; ValueError if fewer are free."""
        if count > len(self.free):
            raise ValueError(f"{count} blocks asked for, {len(self.free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            if block in self.key_of:  # evicted from the prefix cache
                del self.cached[self.key_of.pop(block)[0]]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one hold on each block; a block no one holds becomes free (last block first)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
            elif self.refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than held")

    def match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """The longest run of `tokens`' full blocks from the start that the pool has keyed: those
        blocks (each now held once more) and their keys."""
        blocks, keys, key = [], [], None
        if self.prefix_caching:
            for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
                piece = tokens[start : start + self.block_size]
                key = block_key(key, piece)
                block = self.cached.get(key)
                if block is None or self.key_of[block][1] != tuple(piece):
                    break
                if self.refs[block] == 0:
                    del self.free[block]
                self.refs[block] += 1
                blocks.append(block)
                keys.append(key)
        self.queries += len(tokens)
        self.hits += len(blocks) * self.block_size
        return blocks, keys

    def register(self, block: int, key: int, tokens: list[int]) -> None:
        """Key a full block of computed entries (unless another block holds that key already)."""
        if self.prefix_caching and key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = (key, tuple(tokens))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks stay free, unkeyed). RuntimeError, changing
        nothing, while any block is held: running sequences hold entries of the old weights."""
        held = sum(count > 0 for count in self.refs)
        if held:
            raise RuntimeError(f"{held} blocks are held by running sequences: finish or cancel them first")
        self.cached.clear()
        self.key_of.clear()
