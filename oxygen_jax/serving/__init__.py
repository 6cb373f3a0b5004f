"""Floor 4: serving robots over the network: the wire format, the cross-robot batcher and the policy server."""
