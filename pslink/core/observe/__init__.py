"""Seeing the service: Prometheus metrics and a live page served by pMaster
(:mod:`~pslink.core.observe.http`), and each worker's timeline (:mod:`~pslink.core.observe.timeline`)."""
