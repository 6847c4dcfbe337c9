"""What tests and benchmarks use from the package: tiny random models built from a config (never
downloaded), and the named fault points where a test makes a run crash, fail or pause."""
