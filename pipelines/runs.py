"""Named Dagster runs from the command line: each `txnlake` command runs one of the code location's
jobs in this process, against the instance the UI reads, as a run the UI can list and re-execute.

A run the UI can re-execute needs the job's name and the code location's origin (location
`txnlake`, as workspace.yaml and pyproject.toml name it): `execute_in_process` records neither, so
the run is created here with both, then executed in process (one SparkSession for its steps).
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from pathlib import Path
from typing import Iterable, Mapping

from txn_engine.core.errors import TxnlakeError

LOCATION_NAME = "txnlake"  # workspace.yaml's location_name, pyproject's code_location_name
DEFINITIONS_MODULE = "pipelines.definitions"
REPOSITORY_NAME = "__repository__"  # what Dagster names the repository of a module's `defs`
ASSET_JOB = "__ASSET_JOB"  # the implicit job of every asset: what the UI's "Materialize" launches
COMMAND_TAG = "txnlake/command"  # the command line that started the run
SOURCE_TAG = "txnlake/source"
COMMAND_TAG_MAX = 1000  # characters of the command line kept (file lists can be long)
REPO = Path(__file__).resolve().parent.parent

# The run being executed by this process, for the interrupt handler (pipelines.cli): (instance, run_id).
current_run: dict = {}


def command_tags(argv: Iterable[str]) -> dict[str, str]:
    line = "txnlake " + shlex.join(argv)
    if len(line) > COMMAND_TAG_MAX:
        line = line[: COMMAND_TAG_MAX - 3] + "..."
    return {COMMAND_TAG: line, SOURCE_TAG: "cli"}


def remote_job_origin(job_name: str):
    """The origin the UI gives runs of `job_name` it launches: location `txnlake`, module `pipelines.definitions`."""
    from dagster._core.remote_origin import ManagedGrpcPythonEnvCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    target = LoadableTargetOrigin(executable_path=sys.executable, module_name=DEFINITIONS_MODULE,
                                  working_directory=str(REPO))
    location = ManagedGrpcPythonEnvCodeLocationOrigin(loadable_target_origin=target, location_name=LOCATION_NAME)
    return RemoteJobOrigin(repository_origin=RemoteRepositoryOrigin(location, REPOSITORY_NAME), job_name=job_name)


def job_code_origin(job_name: str):
    """How a process (the run launcher's, `execute_job`) loads the job: `defs` of pipelines.definitions."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    repo = ReconstructableRepository.for_module(DEFINITIONS_MODULE, "defs", working_directory=str(REPO))
    return repo.get_reconstructable_job(job_name).get_python_origin()


def _definitions(loggers: Mapping):
    """The code location's Definitions with the resources as configured now (tests swap them) and our console."""
    from dagster import Definitions, in_process_executor

    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, RESOURCES, defs

    return Definitions(assets=ALL_ASSETS, asset_checks=ALL_CHECKS, jobs=list(defs.jobs or ()), resources=RESOURCES,
                       loggers=dict(loggers), executor=in_process_executor)


def run_job(job_name: str, instance, *, run_config: dict | None = None, asset_selection: Iterable | None = None,
            asset_check_selection: Iterable | None = None, partition_key: str | None = None,
            partition_range: tuple[str, str] | None = None, tags: Mapping[str, str] | None = None, loggers=None):
    """Run the named job (or ASSET_JOB) in this process as a run of the code location; return its result.

    A user error (TxnlakeError) in a step is raised as itself, with a note naming the run that holds the log.
    """
    from dagster import AssetCheckKey, AssetKey, DagsterExecutionStepExecutionError
    from dagster._core.definitions.job_base import InMemoryJob
    from dagster._core.execution.api import create_execution_plan, execute_run
    from dagster._core.snap import snapshot_from_execution_plan

    from assets.partitions import range_tags

    defs = _definitions(loggers or {})
    job = defs.resolve_implicit_global_asset_job_def() if job_name == ASSET_JOB else defs.resolve_job_def(job_name)
    assets = {AssetKey.from_coercible(k) if not isinstance(k, AssetKey) else k for k in asset_selection} if asset_selection is not None else None
    checks = set(asset_check_selection) if asset_check_selection is not None else None
    if checks is not None:
        checks = {c if isinstance(c, AssetCheckKey) else AssetCheckKey(*c) for c in checks}
    run_tags = {**job.run_tags, **(tags or {})}
    if partition_key is not None:
        run_tags["dagster/partition"] = partition_key
    if partition_range is not None:
        run_tags.update(range_tags(*partition_range))
    subset = job.get_subset(asset_selection=assets, asset_check_selection=checks) if (assets or checks) else job
    config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}, **(run_config or {})}
    plan = create_execution_plan(InMemoryJob(subset), run_config=config, instance_ref=instance.get_ref()
                                 if instance.is_persistent else None, tags=run_tags)
    run = instance.create_run(
        job_name=job.name, run_id=str(uuid.uuid4()), run_config=config, resolved_op_selection=None,
        step_keys_to_execute=plan.step_keys_to_execute, status=None, tags=run_tags, root_run_id=None,
        parent_run_id=None, job_snapshot=subset.get_job_snapshot(),
        execution_plan_snapshot=snapshot_from_execution_plan(plan, subset.get_job_snapshot_id()),
        parent_job_snapshot=subset.get_parent_job_snapshot(), op_selection=None,
        asset_selection=frozenset(assets) if assets else None,
        asset_check_selection=frozenset(checks) if checks is not None else None,
        remote_job_origin=remote_job_origin(job.name), job_code_origin=job_code_origin(job.name),
        asset_graph=job.asset_layer.asset_graph,
    )
    current_run.update(instance=instance, run_id=run.run_id)
    try:
        result = execute_run(InMemoryJob(job), run, instance, raise_on_error=True)
        current_run.clear()  # kept on an interrupt (not an Exception), for the command to report
        return result
    except Exception as exc:
        current_run.clear()
        # In process, Dagster raises the step's own exception (or wraps it in a step error).
        cause = (exc.user_exception or exc.__cause__) if isinstance(exc, DagsterExecutionStepExecutionError) else exc
        if isinstance(cause, TxnlakeError):
            where = ("an ephemeral Dagster instance" if instance.is_ephemeral
                     else f"the Dagster instance at {instance.root_directory} (`make ui` shows it)")
            cause.add_note(f"run {run.run_id} of job {job.name} failed; its full log is in {where}")
            raise cause from None
        raise


def dagster_home() -> str:
    return os.path.abspath(os.environ.get("DAGSTER_HOME") or ".dagster_home")
