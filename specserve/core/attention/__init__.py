"""Attention paths under the model adapter: grouped-query SDPA over a masked block and ragged batches row by row
(``sdpa``), one FlexAttention call per layer for a whole ragged batch (``flex``), and the sliding windows of a
model's layers applied in the masks (``windows``).

Knows tensors and masks only: not the KV cache's layout (``core.kv``), not which model runs (``core.model``).
"""
