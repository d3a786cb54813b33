"""The framework-free core: protocol, transports, Agent, Aggregator, pMaster and their logic."""
