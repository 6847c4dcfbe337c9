"""The input rows: finding the Parquet files (local or on an object store) and streaming their
rows part by part, preparing each row as a request, ordering a part's requests, duplicate ids,
and static shards (which parts one of N processes owns)."""
