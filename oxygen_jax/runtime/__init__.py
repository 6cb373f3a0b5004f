"""Floor 3: the unified-KV runtime: the decode slot pool, compiled frame programs, the host scheduler and `Engine`."""
