"""The step loop: `Engine` (add requests, step, abort, generate), each request's output side, and the
counters. Each step is one call down and one result back (loop/engine).
"""
