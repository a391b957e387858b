"""The KV cache's bookkeeping: the block pool, the prefix cache and its disk tier, the KV event
log, and the manager that gives each request its blocks. No tensors but the disk tier's copies."""
