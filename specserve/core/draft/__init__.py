"""The draft side's contracts: what a drafter is and returns (``drafter``: ``Drafter``, ``Draft``, ``Proposal``), the
budget a schedule grants before a cycle and the observation it gets after (``schedule``), and the drafter spec
strings every edge parses (``spec_strings``, torch-free).

Implementations live in :mod:`specserve.drafters` and policies in :mod:`specserve.policies`; both meet here. Knows
nothing of verification: a drafter proposes and is told what was committed (the draft half of a request's cycle,
``core.draft_side``, drives it).
"""
