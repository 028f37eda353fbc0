"""One package per dialect, each its request to the job and the job's events to its answer."""
