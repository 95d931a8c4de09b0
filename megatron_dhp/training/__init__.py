"""Training end to end: config, data pipeline, train loop, checkpoints, calibration and the demo."""
