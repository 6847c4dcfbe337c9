"""The state of every sequence and who owns it: the scheduler (the only writer of a sequence's
progress and status), the step's contract as data (its output, the chunks, draws and what changed;
the runner's output back), sequences and the KV block manager (block tables, prefix-cache
hashes). No tensors here.
"""
