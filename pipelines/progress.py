"""What a `txnlake` command tells its operator while it works, on stderr: a line per stage (each
step of its Dagster runs, and what txn_engine reports on the `txnlake` logger, such as a wait for a
lock), a heartbeat with Spark's task progress when a stage has been quiet for a few seconds, and
nothing but errors under `--quiet`. The command's results and summary go to stdout.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

HEARTBEAT_S = 5.0  # the longest a running command stays silent

# Dagster events shown as a stage line; the others (outputs, handled inputs, materializations the
# summary lists, engine events) would bury them.
_STEP_EVENTS = {"STEP_START": "started", "STEP_SUCCESS": "done", "STEP_SKIPPED": "skipped"}


def spark_progress() -> str | None:
    """Spark's running stages and their tasks, when this process has a session; None otherwise."""
    spark = sys.modules.get("resources.spark")  # not imported: no session (and no import from here)
    session = spark.running_session() if spark is not None else None
    if session is None:
        return None
    try:
        tracker = session.sparkContext.statusTracker()
        stages = [s for s in (tracker.getStageInfo(i) for i in tracker.getActiveStageIds()) if s is not None]
    except Exception:  # the session stopping under us: no progress to show
        return None
    if not stages:
        return "Spark: between jobs"
    done = sum(s.numCompletedTasks for s in stages)
    total = sum(s.numTasks for s in stages)
    rows = _rows_so_far(session)
    return f"Spark: {len(stages)} stage(s) running, {done}/{total} tasks done" + (f", {rows}" if rows else "")


def _rows_so_far(session) -> str | None:
    """Rows the running stages' finished tasks read and wrote (Spark's status store, which the
    status tracker does not expose), e.g. `1,250,000 rows read, 40 written`; None when unknown."""
    try:
        stages = session.sparkContext._jsc.sc().statusStore().activeStages()
        read = written = 0
        for i in range(stages.size()):
            stage = stages.apply(i)
            read += stage.inputRecords() + stage.shuffleReadRecords()
            written += stage.outputRecords() + stage.shuffleWriteRecords()
    except Exception:  # the session stopping under us, or a Spark without this store
        return None
    return f"{read:,} rows read, {written:,} written" if read or written else None


class Console:
    """The command's stage lines (stderr), timed from the command's start."""

    def __init__(self, quiet: bool = False, stream=None, heartbeat_s: float = HEARTBEAT_S):
        self.quiet = quiet
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.started = time.monotonic()
        self.last = self.started
        self.stage: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self, text: str) -> None:
        self.last = time.monotonic()
        if not self.quiet:
            print(f"  [{self.last - self.started:6.1f}s] {text}", file=self.stream or sys.stderr, flush=True)

    def begin(self, stage: str) -> None:
        self.stage = stage
        self.line(f"{stage} ...")

    def __enter__(self) -> "Console":
        logging.getLogger("txnlake").addHandler(_ConsoleHandler(self))
        logging.getLogger("txnlake").setLevel(logging.INFO)
        if not self.quiet:
            self._thread = threading.Thread(target=self._beat, name="txnlake-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and the stage lines of txn_engine's logger (idempotent)."""
        self._stop.set()
        logger = logging.getLogger("txnlake")
        for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler) and h.console is self]:
            logger.removeHandler(handler)

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s / 2)):
            if time.monotonic() - self.last >= self.heartbeat_s and self.stage:
                self.line(f"{self.stage}: working ({spark_progress() or 'in Python'})")

    def dagster_logger(self):
        """A Dagster console logger writing this console's stage lines; user errors without their traces
        (the command prints them as one line), other failures with theirs."""
        from dagster import Field, LoggerDefinition

        console = self

        def make(init_context):
            level = getattr(logging, init_context.logger_config["log_level"].upper(), logging.INFO)
            # Dagster logs its events (a step's start and end) at DEBUG: the handler picks them.
            logger = logging.Logger("txnlake.dagster", level=logging.DEBUG)
            logger.addHandler(_DagsterHandler(console, level))
            return logger

        return LoggerDefinition(make, config_schema={"log_level": Field(str, is_required=False, default_value="INFO"),
                                                     "name": Field(str, is_required=False, default_value="dagster")},
                                description="txnlake's console: a line per step, errors as one line.")


class _ConsoleHandler(logging.Handler):
    """txn_engine's own reports (the `txnlake` logger: waits for locks, stage progress) as stage lines."""

    def __init__(self, console: Console):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        self.console.line(prefix + record.getMessage())


class _DagsterHandler(logging.Handler):
    def __init__(self, console: Console, level: int):
        super().__init__(logging.DEBUG)
        self.console = console
        self.messages_from = level  # the level of a step's own messages shown

    def emit(self, record: logging.LogRecord) -> None:
        from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR

        meta = getattr(record, LOG_RECORD_METADATA_ATTR, None) or {}
        event = meta.get("dagster_event")
        step = meta.get("step_key")
        if event is None:  # a step's own log line (context.log)
            if record.levelno >= self.messages_from:
                text = meta.get("orig_message", record.getMessage())
                prefix = "warning: " if record.levelno >= logging.WARNING else ""
                where = f"{step}: " if step and not text.startswith(f"{step}:") else ""
                self.console.line(f"{where}{prefix}{text}")
            return
        from dagster import DagsterEventType as Kind

        kind = event.event_type
        if kind.value in _STEP_EVENTS:
            if kind == Kind.STEP_START:
                self.console.stage = step
            self.console.line(f"{step}: {_STEP_EVENTS[kind.value]}")
        elif kind == Kind.RUN_START:
            self.console.line(f"run {meta.get('run_id')} of job {meta.get('job_name')}: started")
        elif kind == Kind.RUN_CANCELED:
            self.console.line(f"run {meta.get('run_id')}: cancelled")
        elif kind in (Kind.STEP_FAILURE, Kind.RUN_FAILURE):
            _on_failure(self.console, event, step, record)


def _on_failure(console: Console, event, step: str | None, record: logging.LogRecord) -> None:
    error = getattr(event.event_specific_data, "error", None)
    if error is not None and error.cls_name == "DagsterExecutionStepExecutionError" and error.cause is not None:
        error = error.cause
    name = getattr(error, "cls_name", None)
    if name in ("DagsterExecutionInterruptedError", "KeyboardInterrupt"):
        mark_cancelling()
        return
    if name in user_error_names():
        console.line(f"{step or 'run'}: failed")  # the command prints the error itself, as one line
        return
    # Not a user error: keep everything a developer needs.
    console.line(f"{step or 'run'}: FAILED")
    print(record.getMessage(), file=console.stream or sys.stderr, flush=True)


def user_error_names() -> set[str]:
    from txn_engine.core.errors import TxnlakeError

    names, todo = set(), [TxnlakeError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def mark_cancelling() -> None:
    """Mark the run this process executes as cancelling: Dagster then ends it CANCELED, not FAILURE
    (an interrupt inside a step reaches Dagster before it reaches the command)."""
    from dagster import DagsterRunStatus

    from pipelines.runs import current_run

    instance, run_id = current_run.get("instance"), current_run.get("run_id")
    if instance is None:
        return
    run = instance.get_run_by_id(run_id)
    if run is not None and run.status in (DagsterRunStatus.STARTED, DagsterRunStatus.STARTING,
                                          DagsterRunStatus.NOT_STARTED):
        instance.report_run_canceling(run, message="interrupted (Ctrl-C or SIGTERM) at the command line")
