"""The real redis-server the shared-tier tests start (shared with the benchmark's replicas scenario)."""

from mmserve.bench.redis_server import RedisServer, free_port

__all__ = ["RedisServer", "free_port"]
