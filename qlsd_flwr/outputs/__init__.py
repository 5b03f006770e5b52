"""What a run writes and shows: the run folder (samples for ArviZ, metrics, summary), atomic
checkpoints and resume, the progress display, and the observer that records a protocol server's
rounds. The protocol and the engines compute; this package does their file I/O."""
