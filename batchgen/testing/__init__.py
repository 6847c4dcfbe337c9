"""Fixtures for tests and benchmarks: tiny random models built from a config, never downloaded."""
