"""Starting ranks: N local ranks with torchrun's environment (`ranks`), a rank that exits with the process that
started it (`parent`), and megatron-core on a CPU with gloo (`cpu_shim`).

Used by `megatron-dhp train`/`demo`/`selftest` when they spawn their own ranks; under torchrun or Megatron-LM
only the shim applies (on a CPU). Import the modules directly (nothing is re-exported here).
"""
