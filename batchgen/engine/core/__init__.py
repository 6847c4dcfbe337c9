"""The state of every sequence and who owns it: the scheduler (the only writer of a sequence's
progress and status), its output (the step's chunks and what changed, as data), sequences and
the KV block manager (block tables, prefix-cache hashes). No tensors here.
"""
