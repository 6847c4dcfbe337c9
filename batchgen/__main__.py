"""`python -m batchgen` is the `batchgen` command."""

from batchgen.cli import main

main()
