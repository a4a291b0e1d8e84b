"""The real redis-server the shared-tier tests start (shared with the benchmark's replicas scenario).
One `RedisServer` owns one process: use it as a context manager (or `start()` and `kill()` in
`finally`); starting it while it runs is an error, and `tests/test_bench_processes.py` checks that
nothing it starts outlives the test."""

from mmserve.bench.redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]
