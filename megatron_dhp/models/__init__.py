"""The models megatron-dhp's own commands build: megatron-core's GPTModel with dynamic-CP attention (`gpt`) and an
InternVL-shaped vision-language model around it (`vlm`), as `train`, `demo`, `profile` and `selftest` run them.

Under Megatron-LM the model is Megatron-LM's own; these are for the commands that start ranks themselves.
"""
