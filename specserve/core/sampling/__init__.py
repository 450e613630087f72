"""What a request asks of the target's distribution, and how logits become that distribution.

``params`` holds :class:`~specserve.core.sampling.params.SamplingParams` (checked when made, torch-free: every front end
builds one); ``warps`` turns logits into the distribution the target samples from (temperature, top-k, top-p, min-p)
and draws from it with a request's own generator.

Knows nothing of drafts, trees, KV or models: the acceptance rules above (``core.verify``) compare the distributions
built here.
"""
