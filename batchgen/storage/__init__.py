"""Where files live: local folders and object stores (S3, GCS). URIs and their storage options,
the `Storage` an output is read and written through (local: temp file, fsync, no-replace link;
object stores: one conditional request per object), and retries on transient store errors."""
