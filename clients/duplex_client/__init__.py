"""Python SDK and CLI for duplex-server."""
