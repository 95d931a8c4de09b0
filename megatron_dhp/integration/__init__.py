"""Glue between megatron-dhp and Megatron: CPU compatibility today; flags, hooks and config later."""
