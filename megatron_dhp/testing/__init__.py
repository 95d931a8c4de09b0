"""What only tests and benches use: host-sync and op counters (`host_sync`), virtual groups that run every rank of
a group in one process (`virtual_group`), and upstream Megatron-LM recipes (`megatron_recipe`).

The top floor (tests/test_layering.py): no module of the package imports it. Import the modules directly.
"""
