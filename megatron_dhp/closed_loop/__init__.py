"""The closed loop: plans that follow the ranks as they run. One package that measures, estimates and decides.

measuring    `slot_clock`       each rank's slot seconds (wall time, or CUDA events read a step late), behind the
                                runtime's `runtime.slot_timer.SlotTimer` protocol, so the runtime never imports it
             `injection`        fault injection (`slow_ranks`): a wrapper around the clock, put on only when set
estimating   `speed_estimator`  each rank's speed from measured over predicted seconds, predicted for the step it plans
             `scale_fit`        the cost model's own correction: factors on its attention and on its other seconds
deciding     `loop`             `ClosedLoop`: each rank's report, every rank's reports in, the model plans use (the
                                engine's `runtime.engine.Feedback`)

Its estimating and deciding modules are planning code (numbers only, no process group: `tests/test_layering.py`);
the measuring ones touch torch and the process groups. The rules every part shares about rank speeds (their one
grid, what a slow rank is, how logs name one) are `plan.rank_speeds`'s. docs/closed-loop.md walks through the loop.
"""
