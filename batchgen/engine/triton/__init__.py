"""The Triton attention backend ("triton"): paged attention read in place through block tables, one
launch per layer for the whole step; triton is imported only when a backend is made.
"""
