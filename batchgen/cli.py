"""The `batchgen` command line: run, validate, estimate and report; the only place that prints."""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

import click

from batchgen.errors import EXIT_INTERNAL, EXIT_INTERRUPTED_BASE, EXIT_KERNELS_UNBUILT, BatchgenError, Interrupted
from batchgen.inputs.sharding import ShardSpec
from batchgen.job.spec import load_job
from batchgen.run import interrupt
from batchgen.storage.uris import display_uri

_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override a job file value, e.g. --set sampling.max_tokens=64 (repeatable).",
)


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> ShardSpec | None:
    try:
        return None if value is None else ShardSpec.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_single_writer_option = click.option(
    "--single-writer",
    is_flag=True,
    help="Object stores without conditional writes: you vouch that one run at a time writes this output "
    "(the same as output.single_writer: true).",
)


@click.group()
@click.version_option(package_name="batchgen")
def main() -> None:
    """batchgen: offline batch inference over Parquet prompt datasets."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--quiet", is_flag=True, help="Print errors and the final summary line only (for cron).")
@click.option("--overwrite", is_flag=True, help="Replace an output folder made by a different job.")
@_single_writer_option
@click.option(
    "--shard",
    callback=_shard,
    metavar="I/N",
    help="Only the parts of static shard I of N (part p belongs to shard p % N; I counts from 0).",
)
@click.option(
    "--allow-precision-change",
    is_flag=True,
    help="Resume even where the device type or dtype resolves differently from the parts already "
    "committed (the _SUCCESS manifest lists every runtime).",
)
def run(
    job_file: str,
    overrides: tuple[str, ...],
    quiet: bool,
    overwrite: bool,
    single_writer: bool,
    shard: ShardSpec | None,
    allow_precision_change: bool,
) -> None:
    """Run JOB_FILE: answer every input row and write the output Parquet dataset.

    A rerun after a crash or kill resumes: committed parts are kept, the rest is computed.
    """
    if shard is not None and overwrite:
        raise click.UsageError(
            "--overwrite cannot be combined with --shard: each shard would delete the others' parts; "
            "delete the output folder first instead"
        )
    _setup_logging(logging.ERROR if quiet else logging.INFO)
    from batchgen.run.runner import JobRunner

    def work() -> None:
        spec = load_job(job_file, [*overrides, *(["output.single_writer=true"] if single_writer else [])])
        runner = JobRunner(spec, quiet, overwrite, shard, allow_precision_change)
        summary = runner.run()
        click.echo(f"batchgen: {summary.line()}")
        if not quiet:
            click.echo(f"batchgen: output in {display_uri(spec.output.path)}")
            if spec.output.format == "openai_batch" and summary.manifest:  # (written once the job is complete)
                click.echo(f"batchgen: OpenAI batch output in {display_uri(spec.output.path)}/_batch_output.jsonl")

    _guarded(work)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check JOB_FILE, its inputs and the model folder without loading weights or running anything."""
    _setup_logging(logging.WARNING)
    from batchgen.inputs.dataset import planned_rows
    from batchgen.job.adapters import adapter_lines
    from batchgen.run.validate import dtype_line, input_listing, validate_job

    def work() -> None:
        spec = load_job(job_file, list(overrides))
        files = validate_job(spec)
        rows = planned_rows(files, spec.input.limit)
        click.echo(f"batchgen: {job_file} is valid: {len(files)} input file(s), {rows} rows, model {spec.model.path}")
        for line in input_listing(files, spec.input.limit):
            click.echo(f"  {line}")
        click.echo(f"  {dtype_line(spec)}")
        for line in adapter_lines(spec):
            click.echo(f"  {line}")

    _guarded(work)


def _price(ctx: click.Context, param: click.Parameter, value: str | None) -> Decimal | None:
    if value is None:
        return None
    try:
        price = Decimal(value)
    except InvalidOperation:
        raise click.BadParameter(f"{value!r} is not a number") from None
    if not price.is_finite() or price < 0:
        raise click.BadParameter(f"{value!r} must be a finite number >= 0")
    return price


def _price_options(command: Callable[..., None]) -> Callable[..., None]:
    for name, what in (("output", "output"), ("cached-input", "cached input"), ("input", "input")):
        command = click.option(
            f"--price-{name}",
            callback=_price,
            metavar="PRICE",
            help=f"Price per million {what} tokens (overrides the job's pricing).",
        )(command)
    return command


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_price_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for Airflow XCom) instead of a table.")
def estimate(
    job_file: str,
    overrides: tuple[str, ...],
    price_input: Decimal | None,
    price_cached_input: Decimal | None,
    price_output: Decimal | None,
    as_json: bool,
) -> None:
    """Tokenize JOB_FILE's inputs as `run` would, without loading weights: rows, input tokens, failing
    rows, prefix-cache hits and the cost range."""
    _setup_logging(logging.WARNING)
    from batchgen.usage.estimate import estimate_job, to_json, to_text
    from batchgen.usage.pricing import Prices

    def work() -> None:
        spec = load_job(job_file, list(overrides))
        prices = Prices.from_section(spec.pricing).overridden(price_input, price_cached_input, price_output)
        est = estimate_job(spec)
        click.echo(to_json(est, spec, prices) if as_json else to_text(est, spec, prices), nl=False)

    _guarded(work)


@main.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--by", metavar="COLUMN", help="Group rows by this output column (e.g. a carried category).")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), help="Take prices from this job's pricing section.")
@_price_options
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV: the totals row, then one row per group.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), help="Write a self-contained HTML page here.")
def report(
    output_dir: str,
    by: str | None,
    job_file: str | None,
    price_input: Decimal | None,
    price_cached_input: Decimal | None,
    price_output: Decimal | None,
    as_csv: bool,
    as_json: bool,
    html_file: str | None,
) -> None:
    """Usage and cost of OUTPUT_DIR (finished or still running): totals and, with --by, per group."""
    _setup_logging(logging.WARNING)
    from batchgen.errors import InputDataError
    from batchgen.usage import render as render_as
    from batchgen.usage.html import write_html
    from batchgen.usage.pricing import Prices
    from batchgen.usage.report import read_report

    if as_csv + as_json + (html_file is not None) > 1:
        raise click.UsageError("choose one of --csv, --json, --html")

    def work() -> None:
        base = Prices.from_section(load_job(job_file).pricing) if job_file else Prices()
        prices = base.overridden(price_input, price_cached_input, price_output)
        result = read_report(output_dir, by)
        if html_file is not None:
            write_html(result, prices, html_file)
            click.echo(f"batchgen: {result.status.line()}\nbatchgen: report written to {html_file}")
        else:
            render = render_as.to_csv if as_csv else render_as.to_json if as_json else render_as.to_text
            click.echo(render(result, prices), nl=False)
        if result.status.mismatches:
            raise InputDataError(
                f"{display_uri(output_dir)}: the committed parts disagree with _SUCCESS: "
                + "; ".join(result.status.mismatches)
            )

    _guarded(work)


@main.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@_single_writer_option
def finalize(output_dir: str, single_writer: bool) -> None:
    """Write OUTPUT_DIR's _SUCCESS once every part is committed (after shard runs); idempotent.

    Exits 8, naming the missing parts, while some are not committed.
    """
    _setup_logging(logging.WARNING)
    from batchgen.outputs.completion import finalize as finalize_output

    def work() -> None:
        manifest, already = finalize_output(output_dir, single_writer)
        rows = manifest["rows"]
        what = "already finalized" if already else "finalized"
        click.echo(
            f"batchgen: {display_uri(output_dir)} {what}: {manifest['parts']} parts, {rows['ok']} rows ok, "
            f"{rows['error']} failed"
        )

    _guarded(work)


@main.command()
@click.option("--build", is_flag=True, help="Build the native CPU kernels this machine lacks (e.g. in a Dockerfile).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--remeasure",
    is_flag=True,
    help="Forget the kernel choices measured on this machine (kept for good once measured), so the next "
    "engine measures them again; run it while no job runs here.",
)
def doctor(build: bool, as_json: bool, remeasure: bool) -> None:
    """What this machine gives the engine: device, versions, compilers, each native kernel's state, and the
    kernel choices measured here."""

    def work() -> None:
        import json

        from batchgen import doctor as checks

        if remeasure:
            click.echo(checks.forget_measured(), err=True)
        facts = checks.report(build=build)
        click.echo(json.dumps(facts, indent=2) if as_json else "\n".join(checks.lines(facts)))
        failed = [k["name"] for k in facts["kernels"] if k["state"] == "unavailable"]
        if build and failed:  # why an exit code: `RUN batchgen doctor --build` must fail the image build
            click.echo(
                f"batchgen: {len(failed)} of {len(facts['kernels'])} kernels could not be built ({', '.join(failed)}; "
                "see above why): the engine would use torch's own path for those",
                err=True,
            )
            sys.exit(EXIT_KERNELS_UNBUILT)

    _guarded(work)


def _guarded(work) -> None:  # type: ignore[no-untyped-def]
    """Turn errors into one clear line on stderr and the documented exit code."""
    try:
        with interrupt.installed():
            work()
            sys.stdout.flush()  # why here: a closed pipe must surface now, not at interpreter exit
    except BrokenPipeError:
        _exit_on_closed_stdout()
    except BatchgenError as exc:
        click.echo(f"batchgen: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        click.echo(
            f"batchgen: interrupted by {signal.Signals(signum).name}; committed parts are kept, run again to resume",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED_BASE + signum)
    except Exception:
        logging.getLogger("batchgen").exception("internal error")
        sys.exit(EXIT_INTERNAL)


def _exit_on_closed_stdout() -> None:
    """The reader went away (`| head -1`): stop quietly, as Unix tools do, with 128 + SIGPIPE."""
    try:
        # Why: Python flushes stdout again at exit; pointing it at /dev/null keeps that quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # not a real file descriptor (an in-process test runner): nothing left to flush
    sys.exit(EXIT_INTERRUPTED_BASE + signal.SIGPIPE)


def _setup_logging(level: int) -> None:
    """Log from `level` up. At ERROR (run --quiet) that covers transformers' logs, Python warnings
    and the libraries' progress bars too, so cron logs hold errors and the summary line only."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)  # Python warnings become log records, filtered like the rest
    # Why: transformers' own info logs would drown the progress bar.
    logging.getLogger("transformers").setLevel(max(level, logging.WARNING))
    if level >= logging.ERROR:
        _silence_library_progress()


def _silence_library_progress() -> None:
    if "transformers" in sys.modules:  # already imported (an in-process caller): tell it directly
        import transformers
        from huggingface_hub.utils import disable_progress_bars

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # "Loading weights" and the like
        disable_progress_bars()
    else:
        # Why the environment: transformers reads its verbosity and the hub's progress-bar switch
        # when it is imported, resetting any logger level set before.
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
