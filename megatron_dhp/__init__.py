"""megatron-dhp: dynamic hybrid (data x context) parallelism for Megatron-Core.

Each training step a planner splits the DP x CP ranks into groups of any size, gives every sequence to one
group, and the runtime runs that group's attention as context parallelism over exactly its ranks.
"""

__version__ = "0.1.0"
