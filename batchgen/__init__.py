"""batchgen: offline batch inference over Parquet prompt datasets."""

__version__ = "0.1.0"
