"""Cluster bootstrap for the distributed runtime: resource math now; Ray start/stop comes with issue 3."""
