"""The worker layer, between the Agent and the framework adapters (see docs/architecture.md)."""
