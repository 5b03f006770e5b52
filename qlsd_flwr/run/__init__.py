"""Running a configured job: engines behind one entry point, outputs, checkpoints, the CLI."""
