"""Running a job: the checks before any work, the runner (lock the output, keep and check the
committed parts, generate the rest, complete), one part's work (the same in the runner's own loop
and on a Ray worker), the executors that run parts elsewhere (Ray), cooperative stopping on
signals, the progress bar and the summary."""
