"""What tests and benchmarks share and users never need: tiny random-weight models built from a
config (never downloaded). Beside the package, not in it: the wheel ships batchgen/ alone
(tests/test_wheel.py checks that these are absent from it)."""
