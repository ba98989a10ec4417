"""Stage backends (one module per backend) and the stage protocol (base.py)."""
