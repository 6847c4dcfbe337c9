"""The `batchgen` command line: run and validate job files; the only place that prints."""

from __future__ import annotations

import logging
import signal
import sys

import click

from batchgen.errors import EXIT_INTERNAL, EXIT_INTERRUPTED_BASE, BatchgenError, Interrupted
from batchgen.job import load_job

_set_option = click.option(
    "--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
    help="Override a job file value, e.g. --set sampling.max_tokens=64 (repeatable).",
)


@click.group()
@click.version_option(package_name="batchgen")
def main() -> None:
    """batchgen: offline batch inference over Parquet prompt datasets."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--quiet", is_flag=True, help="No progress bar; only warnings and the summary line (for cron).")
@click.option("--overwrite", is_flag=True, help="Replace an output folder made by a different job.")
def run(job_file: str, overrides: tuple[str, ...], quiet: bool, overwrite: bool) -> None:
    """Run JOB_FILE: answer every input row and write the output Parquet dataset.

    A rerun after a crash or kill resumes: committed parts are kept, the rest is computed.
    """
    _setup_logging(quiet)
    from batchgen.runner import JobRunner

    def work() -> None:
        spec = load_job(job_file, list(overrides))
        summary = JobRunner(spec, quiet=quiet, overwrite=overwrite).run()
        click.echo(f"batchgen: {summary.line()}")
        click.echo(f"batchgen: output in {spec.output.path}")

    _guarded(work)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check JOB_FILE, its inputs and the model folder without loading weights or running anything."""
    _setup_logging(quiet=True)
    from batchgen.validate import validate_job

    def work() -> None:
        spec = load_job(job_file, list(overrides))
        files = validate_job(spec)
        rows = sum(f.num_rows for f in files)
        click.echo(f"batchgen: {job_file} is valid: {len(files)} input file(s), {rows} rows, model {spec.model.path}")

    _guarded(work)


def _guarded(work) -> None:  # type: ignore[no-untyped-def]
    """Turn errors into one clear line on stderr and the documented exit code."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        work()
    except BatchgenError as exc:
        click.echo(f"batchgen: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        click.echo(f"batchgen: interrupted by {signal.Signals(signum).name}; committed parts are kept, "
                   "run again to resume", err=True)
        sys.exit(EXIT_INTERRUPTED_BASE + signum)
    except Exception:
        logging.getLogger("batchgen").exception("internal error")
        sys.exit(EXIT_INTERNAL)


def _interrupt(signum: int, _frame: object) -> None:
    # Why: raising unwinds the part in flight without committing it, exactly like Ctrl-C.
    raise Interrupted(signum)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Why: transformers' own info logs would drown the progress bar.
    logging.getLogger("transformers").setLevel(logging.WARNING)
