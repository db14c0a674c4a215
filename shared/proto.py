"""proto/: the published contract, generated from the models. Owns every file under proto/.

`python -m muster.shared.proto` rewrites proto/ from `muster.shared.jobconfig.JobConfig`, the message
models and `CHANNELS` (below); `python -m muster.shared.proto --check` exits 1 when proto/ is out of date.

- proto/jobconfig.schema.json       JSON Schema (2020-12) of the job config
- proto/messages/<Name>.schema.json one per message model on a channel (other than JobConfig)
- proto/asyncapi.yaml               AsyncAPI 3.0.0 document of every channel
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from muster.shared import shapes, subjects
from muster.shared.jobconfig import MAX_TASKS_PER_ROLE, JobConfig
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Dataset,
    DrainOrder,
    Endpoint,
    EndpointReported,
    ExecReply,
    ExecRequest,
    JobEvent,
    JobEventKind,
    JobRecord,
    KillOrder,
    KillRequest,
    MembersChanged,
    MetricBatch,
    NodeInfo,
    Question,
    QueueOrder,
    Rendezvous,
    TaskEvent,
    TaskEventKind,
    Verdict,
    VirtualCluster,
)
from muster.shared.subjects import SUBMISSION_ID_RE

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

JOBCONFIG_DESCRIPTION = (
    "A Muster job config: OpenPAI's job config format (jobName, image, taskRoles, ...) plus the "
    "v1 extensions. Empty strings for the path fields (authFile, dataDir, outputDir, codeDir) and "
    "for gpuType mean unset, as in OpenPAI's own examples. Rules spanning fields (unique role "
    "names and port labels, "
    "minFailedTaskCount/minSucceededTaskCount ≤ taskNumber, shmMB ≤ memoryMB, "
    "killAllOnCompletedTaskNumber ≤ total tasks, no MUSTER_ jobEnvs, distinct data mount paths) "
    "and job name uniqueness "
    "are checked by the validator, not by this schema."
)


@dataclass(frozen=True)
class Channel:
    address: str
    parameters: tuple[str, ...]
    message: type[BaseModel]
    action: str  # what a Muster service does on it: "receive" or "send"
    description: str


CHANNELS: dict[str, Channel] = {
    "jobSubmit": Channel(
        address=subjects.SUBMIT_PREFIX + ".{user}",
        parameters=("user",),
        message=JobConfig,
        action="receive",
        description=(
            "Submit a job as {user}: the payload is the job config (JSON, UTF-8, at most 1 MiB). With "
            "authentication on, only identity {user} may publish here, and the job is {user}'s whatever "
            f"the payload or headers say. Optional header: {subjects.Headers.SUBMISSION_ID} (else the stream "
            "sequence). "
            "Captured by stream MUSTER_SUBMISSIONS (work queue) and validated by any validator replica."
        ),
    ),
    "jobKill": Channel(
        address=subjects.KILL_PREFIX + ".{user}",
        parameters=("user",),
        message=KillRequest,
        action="receive",
        description=(
            "Stop one of {user}'s jobs (an admin may send as anyone): every task gets SIGTERM, then "
            "SIGKILL after the grace; the job becomes "
            "STOPPED and is not retried. Captured by stream MUSTER_SUBMISSIONS."
        ),
    ),
    "submissionVerdict": Channel(
        address=subjects.EVENTS_PREFIX + ".submission.{user}.{submissionId}",
        parameters=("user", "submissionId"),
        message=Verdict,
        action="send",
        description="The verdict on one submission: accepted with a job id, or every error found.",
    ),
    "gatewayQuestion": Channel(
        address=subjects.API_PREFIX + ".{user}.{verb}",
        parameters=("user", "verb"),
        message=Question,
        action="receive",
        description=(
            "A question to the gateway, asked as {user} (only identity {user} may publish here; "
            "_all: an admin, about every job), answered by request/reply with JSON: jobs (a page of the "
            "asker's jobs, newest first, filtered, with a cursor to the next), job (one, with its "
            "attempts), verdict (of a submission), logs (a page of output lines after a stream "
            "sequence), metrics (a page of training metric points, the same way), "
            "events (a page of the job's history), vcs (virtual clusters), nodes (a page of the "
            "cluster's nodes, their GPUs free and used, and the allocation over time), ping. Another "
            "user's job is answered as no such job, and a GPU another user's job holds names no job."
        ),
    ),
    "queueOrder": Channel(
        address=subjects.QUEUE,
        parameters=(),
        message=QueueOrder,
        action="send",
        description=(
            "The scheduler leader's waiting queue (core NATS, not kept): after each cycle that "
            "changed it and at least every 10 s while it leads. Only the scheduler may publish it; "
            "every gateway replica keeps the latest, for each waiting job's place in the queue."
        ),
    ),
    "jobEvent": Channel(
        address=subjects.EVENTS_PREFIX + ".job.{jobId}.{kind}",
        parameters=("jobId", "kind"),
        message=JobEvent,
        action="send",
        description=(
            "One fact in a job's history (stream MUSTER_EVENTS): accepted by the validator; "
            "placed (once the job record names the attempt), running, retrying, killed and ended "
            "by the supervisor; preempted and resized by the scheduler."
        ),
    ),
    "nodeAssign": Channel(
        address=subjects.NODE_COMMANDS_PREFIX + ".{node}.assign",
        parameters=("node",),
        message=Assignment,
        action="send",
        description="Scheduler to the node's agent: run these tasks of an attempt (stream MUSTER_COMMANDS).",
    ),
    "nodeKill": Channel(
        address=subjects.NODE_COMMANDS_PREFIX + ".{node}.kill",
        parameters=("node",),
        message=KillOrder,
        action="send",
        description="Stop every task of an attempt on this node: SIGTERM, then SIGKILL after the grace.",
    ),
    "nodeDrain": Channel(
        address=subjects.NODE_COMMANDS_PREFIX + ".{node}.drain",
        parameters=("node",),
        message=DrainOrder,
        action="send",
        description=(
            "An operator drains a node: every task on it is stopped (and retried elsewhere), and the node "
            "takes no new work until undone or its agent restarts (stream MUSTER_COMMANDS)."
        ),
    ),
    "taskEndpoint": Channel(
        address=subjects.EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.endpoint.{node}",
        parameters=("jobId", "attempt", "role", "index", "node"),
        message=EndpointReported,
        action="send",
        description=(
            "An agent reserved this task's ports: its address, before the task starts. Not sent for "
            "a job of one task (not elastic): its agent builds the spec from it alone."
        ),
    ),
    "taskState": Channel(
        address=subjects.EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.{taskEvent}.{node}",
        parameters=("jobId", "attempt", "role", "index", "taskEvent", "node"),
        message=TaskEvent,
        action="send",
        description=(
            "A task started running, or exited (exit code, last lines of output), from {node}: the node "
            "it was placed on (only that node's agent may publish it), or _platform (the supervisor)."
        ),
    ),
    "taskMetrics": Channel(
        address=subjects.METRICS_PREFIX + ".{jobId}.{attempt}.{role}.{index}.{node}",
        parameters=("jobId", "attempt", "role", "index", "node"),
        message=MetricBatch,
        action="send",
        description=(
            "The training metrics a task printed (the job's `metrics`), batched, from the agent of "
            "{node} (only that node's agent may publish it); kept in stream MUSTER_METRICS."
        ),
    ),
    "clusterSpec": Channel(
        address=subjects.EVENTS_PREFIX + ".attempt.{jobId}.{attempt}.spec",
        parameters=("jobId", "attempt"),
        message=ClusterSpec,
        action="send",
        description=(
            "Every endpoint of an attempt's gang, published once when all are in (the barrier); none "
            "for a job of one task (not elastic), whose own endpoint is its whole gang."
        ),
    ),
    "attemptMembers": Channel(
        address=subjects.EVENTS_PREFIX + ".attempt.{jobId}.{attempt}.members",
        parameters=("jobId", "attempt"),
        message=MembersChanged,
        action="receive",
        description=(
            "An elastic attempt's gang changed without a new endpoint (the scheduler removed tasks, "
            "or one ended while its role goes on): the registry publishes the next spec version. "
            "The payload ({}) is ignored; the registry reads the attempt record."
        ),
    ),
    "execRequest": Channel(
        address=subjects.EXEC_PREFIX + ".req.{node}.{sender}",
        parameters=("node", "sender"),
        message=ExecRequest,
        action="receive",
        description=(
            "Agent of {sender} to the agent of {node} (core NATS, not kept): start an MPI daemon in a "
            "task of an attempt whose launcher runs on {sender} (open), or stop it (cancel). Only "
            "identity agent-{sender} may publish it; {node}'s agent refuses a task that is not its own, "
            "not of an MPI job's workers role, or of an attempt whose launcher is not on {sender}."
        ),
    ),
    "execReply": Channel(
        address=subjects.EXEC_PREFIX + ".out.{node}.{sender}",
        parameters=("node", "sender"),
        message=ExecReply,
        action="send",
        description=(
            "Agent of {sender} back to the agent of {node}: a session's output, liveness, exit code "
            "or refusal (core NATS, not kept)."
        ),
    ),
    "nodeRecord": Channel(
        address="$KV." + subjects.NODES_BUCKET + ".{node}",
        parameters=("node",),
        message=NodeInfo,
        action="send",
        description="A node's inventory and last heartbeat (JetStream KV bucket muster_nodes).",
    ),
    "attemptRecord": Channel(
        address="$KV." + subjects.ATTEMPTS_BUCKET + ".{jobId}.{attempt}",
        parameters=("jobId", "attempt"),
        message=AttemptRecord,
        action="send",
        description="An attempt: its placement and every task's state (JetStream KV bucket muster_attempts).",
    ),
    "rendezvousRecord": Channel(
        address="$KV." + subjects.RENDEZVOUS_BUCKET + ".{jobId}.{attempt}",
        parameters=("jobId", "attempt"),
        message=Rendezvous,
        action="send",
        description=(
            "Which tasks' endpoints are collected for an attempt, a bit per task, and the last spec "
            "published (JetStream KV bucket muster_rendezvous)."
        ),
    ),
    "rendezvousEndpoint": Channel(
        address="$KV." + subjects.RENDEZVOUS_BUCKET + ".{jobId}.{attempt}.{role}.{index}",
        parameters=("jobId", "attempt", "role", "index"),
        message=Endpoint,
        action="send",
        description="A task's endpoint as the registry collected it (JetStream KV bucket muster_rendezvous).",
    ),
    "virtualClusterRecord": Channel(
        address="$KV." + subjects.VCS_BUCKET + ".{vc}",
        parameters=("vc",),
        message=VirtualCluster,
        action="receive",
        description=(
            "A virtual cluster as an operator configured it (JetStream KV bucket muster_vcs; only "
            "admins write it): its quota, who may submit to it, the highest priority its jobs may use."
        ),
    ),
    "datasetRecord": Channel(
        address="$KV." + subjects.DATASETS_BUCKET + ".{dataset}",
        parameters=("dataset",),
        message=Dataset,
        action="receive",
        description=(
            "A dataset jobs may mount (`data`), as an operator defined it (JetStream KV bucket "
            "muster_datasets; only admins write it): its source (a host directory or a Docker "
            "volume), whether jobs may write it, who may mount it."
        ),
    ),
    "jobRecord": Channel(
        address="$KV." + subjects.JOBS_BUCKET + ".{jobId}",
        parameters=("jobId",),
        message=JobRecord,
        action="send",
        description="The current record of a job (JetStream KV bucket muster_jobs).",
    ),
}

# Every `{param}` used in a CHANNELS address needs an entry here (AsyncAPI 3 parameter objects).
PARAMETERS: dict[str, dict[str, Any]] = {
    "submissionId": {
        "description": (
            "The submission id: the Muster-Submission-Id header, else the stream sequence "
            f"of the submission ({SUBMISSION_ID_RE})."
        ),
    },
    "jobId": {
        "description": (
            "The job id, derived from the submitter and the submission id ('j' + 12 hex digits; "
            f"any id matches {shapes.JOB_ID_PATTERN})."
        )
    },
    "verb": {
        "description": "What the gateway is asked.",
        "enum": ["ping", "jobs", "job", "verdict", "logs", "metrics", "events", "vcs", "nodes"],
    },
    "user": {
        "description": (
            "Who sends it (an identity's name; with authentication on, the server lets only that "
            f"identity publish under it): {shapes.NAME_PATTERN}."
        ),
    },
    "kind": {
        "description": "What happened to the job.",
        "enum": [k.value for k in JobEventKind],
    },
    "node": {"description": f"A node name, as its agent registered it: {shapes.NAME_PATTERN}."},
    "sender": {
        "description": (
            f"The node whose agent sends it (only that node's agent may publish it): {shapes.NAME_PATTERN}."
        )
    },
    "vc": {"description": f"A virtual cluster's name (a job's virtualCluster): {shapes.NAME_PATTERN}."},
    "dataset": {
        "description": f"A dataset's name (as a job's `data` entries give it): {shapes.NAME_PATTERN}."
    },
    "attempt": {"description": f"The attempt number, from 1 to {shapes.MAX_ATTEMPT}."},
    "role": {"description": f"A task role name from the job config: {shapes.ROLE_PATTERN}, at most 64."},
    "index": {"description": f"The task's index in its role, from 0 to {MAX_TASKS_PER_ROLE - 1}."},
    "taskEvent": {"description": "What happened to the task.", "enum": [k.value for k in TaskEventKind]},
}


def _dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    for sub in [schema, *schema.get("$defs", {}).values()]:
        if sub.get("title") == JobConfig.__name__:
            sub["description"] = JOBCONFIG_DESCRIPTION
    return schema


def _schema_file(model: type[BaseModel], file_id: str, title: str | None = None) -> dict[str, Any]:
    schema = _model_schema(model)
    head = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": file_id,
        "title": title or schema["title"],
        "description": schema.get("description", ""),
    }
    return head | {k: v for k, v in schema.items() if k not in head}


def message_models() -> list[type[BaseModel]]:
    """Every distinct model carried by a channel, in CHANNELS order."""
    return list(dict.fromkeys(channel.message for channel in CHANNELS.values()))


def _to_components(node: Any) -> Any:
    """Rewrite pydantic's `#/$defs/X` refs to `#/components/schemas/X`."""
    if isinstance(node, dict):
        return {
            k: v.replace("#/$defs/", "#/components/schemas/", 1)
            if k == "$ref" and isinstance(v, str)
            else _to_components(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_to_components(v) for v in node]
    return node


def _version() -> str:
    try:
        with (ROOT / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0.2.0"


def asyncapi() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in message_models():
        schema = _to_components(_model_schema(model))
        defs = schema.pop("$defs", {})
        schemas[model.__name__] = schema  # a model's own schema wins over another model's $def
        for name, sub in defs.items():
            schemas.setdefault(name, sub)

    messages = {
        model.__name__: {
            "name": model.__name__,
            "title": schemas[model.__name__].get("title", model.__name__),
            "description": schemas[model.__name__].get("description", ""),
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
        }
        for model in message_models()
    }

    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for cid, channel in CHANNELS.items():
        name = channel.message.__name__
        params = channel.parameters
        missing = [p for p in params if p not in PARAMETERS]
        if missing:
            raise KeyError(f"describe channel parameter(s) {missing} in shared/proto.py PARAMETERS")
        if channel.action not in ("send", "receive"):
            raise ValueError(f"channel {cid}: action must be 'send' or 'receive'")
        channels[cid] = {
            "address": channel.address,
            "description": channel.description,
            **({"parameters": {p: copy.deepcopy(PARAMETERS[p]) for p in params}} if params else {}),
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
        }
        operations[channel.action + cid[0].upper() + cid[1:]] = {
            "action": channel.action,
            "channel": {"$ref": f"#/channels/{cid}"},
            "summary": f"Muster services {channel.action} {name} on {channel.address}.",
            "messages": [{"$ref": f"#/channels/{cid}/messages/{name}"}],
        }

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Muster",
            "version": _version(),
            "description": (
                "Muster's NATS API, generated by `python -m muster.shared.proto` from shared/subjects.py "
                "(CHANNELS) and the pydantic models: do not edit. Operations are described from "
                "the point of view of Muster's services: 'receive' means a Muster service "
                "receives the message, 'send' means one sends it. Every field has a shape (its "
                "schema's pattern, bounds and lengths); a message that does not match its schema "
                "is dropped and counted, never redelivered. Commands (additionalProperties: false) "
                "refuse fields they do not define; events and records ignore them, so that what a "
                "newer version wrote still decodes during an upgrade."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "A local NATS server with JetStream (nats://127.0.0.1:4222).",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def render() -> dict[str, str]:
    """Relative file name under proto/ → file text."""
    files = {
        "jobconfig.schema.json": _dump_json(
            _schema_file(JobConfig, "jobconfig.schema.json", "Muster job config (OpenPAI format)")
        )
    }
    for model in message_models():
        if model is not JobConfig:
            file_id = f"messages/{model.__name__}.schema.json"
            files[file_id] = _dump_json(_schema_file(model, file_id))
    files["asyncapi.yaml"] = yaml.safe_dump(asyncapi(), sort_keys=False, allow_unicode=True, width=100)
    return files


def _on_disk(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def check(directory: Path = PROTO_DIR) -> list[str]:
    """Problems with `directory` against `render()`: 'stale: f', 'missing: f', 'extra: f'."""
    wanted = render()
    problems = []
    for name, text in wanted.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"missing: {name}")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"stale: {name}")
    problems += [f"extra: {name}" for name in sorted(_on_disk(directory) - wanted.keys())]
    return problems


def write(directory: Path = PROTO_DIR) -> list[str]:
    """Make `directory` match `render()` exactly; returns the files written or removed."""
    wanted = render()
    changed = []
    for name, text in wanted.items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(f"wrote {name}")
    for name in sorted(_on_disk(directory) - wanted.keys()):
        (directory / name).unlink()
        changed.append(f"removed {name}")
    for sub in sorted(directory.rglob("*"), reverse=True):
        if sub.is_dir() and not any(sub.iterdir()):
            sub.rmdir()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muster.shared.proto", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if proto/ is out of date")
    parser.add_argument("--dir", type=Path, default=PROTO_DIR, help="proto directory (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.dir)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("proto/ is stale: run python -m muster.shared.proto", file=sys.stderr)
            return 1
        print(f"{args.dir} is up to date")
        return 0
    for line in write(args.dir) or [f"{args.dir} already up to date"]:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
