"""Floor 1: the models as pure functions: the one transformer (`backbone`), vision encoders, action heads,
the prefix they share, language adapters, the one Euler loop (`flow`), and π0.5 (`models.pi05`, a floor
above). Imports only `oxygen_jax.nn`."""
