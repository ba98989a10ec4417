"""Repository tooling (run by the Makefile)."""
