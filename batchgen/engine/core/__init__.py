"""The step loop and the state it owns: requests, sequences, the scheduler and the KV block manager.

The scheduler is the only writer of a sequence's progress and status; each step it hands the
runner an immutable snapshot and the changes since the last one. No tensors here.
"""
