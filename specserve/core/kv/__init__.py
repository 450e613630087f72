"""State that survives a cycle, and how it rolls back: one sequence's KV cache (``cache``: rollback by cropping,
compaction to a tree's accepted path), the recurrent layers of hybrid models (``recurrent``: rollback by checkpoint
and recompute), the KV pool of batched serving sized in tokens (``pool``) with its sequences' recurrent states
(``pool_states``), and the prefix cache over the pool (``prefix_cache``, its index ``prefix_index``) with a drafter's
per-position state of shared prefixes (``prefix_store``).

Knows keys, values, states and token sequences; not how a forward computes them (``core.model``) nor what a verdict
accepted (the verifier tells it how many positions to keep).
"""
