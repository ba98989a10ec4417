"""Stage backends (one module per backend), the stage interface (base.py), the runtimes a
model backend holds (threaded.py, batching.py, on workers.py's worker thread) and replica
pools (pool.py)."""
