"""The execution-settings benchmark (`python -m eval.bench`): `grid` (settings, workloads, grid points), `harness`
(the shared protocol and the group driver), the model families `pi05` and `heads`, and the command line in
`__main__`."""
