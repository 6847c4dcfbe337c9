"""Running a job: the checks before any work, the runner (lock, resume, generate, commit,
complete), the executors that run its parts (in this process or on Ray workers), cooperative
stopping on signals, the progress bar and the summary."""
