"""Proof that a plan runs exactly: the single-process oracle (`reference`) and `selfcheck`, which runs a plan
through the step runtime on real process groups and compares the loss and every gradient with it (the
`selftest` command, the trainer's `profile`, the multi-process tests).
"""
