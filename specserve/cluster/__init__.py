"""Cluster bootstrap for the distributed runtime: placement-group math, joining Ray, the local multi-node cluster."""
