"""Glue between megatron-dhp and its users: the DHP config and step planning."""
