"""The forward: the adapter over a local Hugging Face causal LM (``causal_lm``: load, forward a block, a tree or a
ragged batch with KV, read features), checkpoint directories checked before torch loads (``checkpoint_dir``),
Megatron-style tensor parallelism applied to a loaded model (``tensor_parallel``) and the verify-width buckets a
static-shape forward pads to (``buckets``).

Knows models and their KV (``core.kv``); not the acceptance rules, drafters or requests. Static shapes and captured
steps over this forward live one room up, in ``core.static``.
"""
