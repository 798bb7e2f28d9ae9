"""Reusable helpers for live tests: a real Prometheus/Alertmanager stack, a webhook receiver,
and the 2-rank demo run. Import as ``tests.support.stack`` / ``tests.support.demo``."""
