"""Stage backends (one module per backend), the stage interface (base.py), the worker
runtimes (workers.py, batching.py) and replica pools (pool.py)."""
