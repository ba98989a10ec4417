"""The duplex-server engine: orchestrator, stage pools and the duplex control plane."""
