"""Serving studies: robots against a running `oxygen_jax.serve` (batched vs one at a time, hostile clients, replicas
behind HAProxy) and openpi's closed-loop LIBERO client."""
