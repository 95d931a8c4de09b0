"""Glue between megatron-dhp and its users: the DHP config, step planning, CPU compatibility, Megatron hooks."""
