"""Verification: the exact acceptance rules and what shapes the target's distribution at each verified row.

Chains (``chain``: greedy and rejection sampling, rule A of docs/verification.md) and trees (``tree``: rules B-D), the
drafter-invariant Gumbel coupling (``invariant``, rule E), Medusa's typical acceptance (``typical``: LOSSY, opt-in and
labelled), the logit processors that read the text so far (``processors``), structured output (``grammar``), the
log-probabilities of emitted tokens (``logprobs``) and a batched step's verdicts staged for one host copy
(``staged``). Pure functions over distributions, except the grammar's matcher state.

Knows distributions, drafts and trees; not the model or KV (the target side, ``core.target``, runs the forward and
rolls back what a verdict rejected).
"""
