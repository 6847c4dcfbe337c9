"""The output: the table each part is written as, committing parts exactly once, the job record
(fingerprint, part checks, runtimes), the run lock (flock or lease), the output's state across
runs, `_SUCCESS` and its manifest, and the usage totals counted over output rows."""
