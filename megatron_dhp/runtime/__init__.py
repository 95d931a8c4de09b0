"""Run a plan: dynamic process groups, token dispatch, dynamic context-parallel attention, the step.

Modules import megatron-core and torch.distributed; import them directly (nothing is re-exported here, so
importing the package stays cheap).
"""
