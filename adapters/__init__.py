"""Multi-token head adapters: one head type per module, registered by name."""
