"""Check the runtime: the test models, the single-process oracle, local launch of N ranks, the CPU shim, and
`selfcheck` (the `selftest` command and the multi-process tests).

Sits above `runtime` (it runs plans through it); the runtime never imports it. Modules import megatron-core
and torch.distributed; import them directly (nothing is re-exported here).
"""
