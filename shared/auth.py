"""Who may do what on the bus: identities, their NATS permissions, and the files that hold them.

Muster uses NATS's own authorization: every client connects as an nkey user (an Ed25519 key pair;
the server holds only public keys and checks a signed nonce, so no secret crosses the wire and a
leaked server config leaks nothing), and the server enforces a publish/subscribe allow-list per
identity. Identity is carried in the subjects it may use: a user `alice` may publish only
`muster.job.submit.alice`, an agent of node `n1` only subjects ending in `.n1`, so a service
that reads the token from the subject knows who sent the message — the server checked it.

Roles:
- admin: everything (sees and kills every job, drains nodes, declares streams).
- user: submit and kill as itself; ask the gateway about its own jobs; read its own verdicts.
- validator, scheduler, registry, supervisor, gateway: the subjects, streams and buckets the
  service uses, nothing else (no service may create, change or delete a stream).
- agent (one identity per node): its own node's record, task events, endpoints, logs and metrics; its
  own node's orders; the cluster specs and attempt records it needs to run and recover tasks.
- sim (`sim-agents`, benchmarks only): an agent on *every* node, for a process that holds
  thousands of simulated nodes on one connection (services/agent/sim.py). It can act as any
  node, so it must never be given out on a bus that runs real work; only `muster up --runtime
  sim` and `muster admin keys --sim` make it.

Files (in an auth directory, `<data dir>/auth` for `muster up`):
- `identities.json`: name, role, node and public key of every identity (no secrets);
- `creds/<name>.creds`: one identity's secret seed (JSON, mode 0600): what a client uses;
- `auth.conf`: the server's `authorization` block, generated from `identities.json`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from muster.shared import subjects

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
SERVICES = ("validator", "scheduler", "registry", "supervisor", "gateway")
ROLES = ("admin", "user", "agent", "sim", *SERVICES)
SIM_IDENTITY = "sim-agents"  # the one identity of role sim
CREDENTIALS_ENV = "MUSTER_CREDENTIALS"


class AuthError(ValueError):
    """A bad identity, or a credentials file that cannot be used (the reason says which)."""


@dataclass(frozen=True)
class Credentials:
    """What a client holds: its name, role and secret nkey seed. Never logged."""

    name: str
    role: str
    seed: str
    node: str | None = None

    def __repr__(self) -> str:
        return f"Credentials(name={self.name!r}, role={self.role!r})"

    @property
    def inbox(self) -> str:
        """The reply-subject prefix this identity alone may subscribe to."""
        return inbox(self.name)

    @property
    def public_key(self) -> str:
        import nkeys

        return str(nkeys.from_seed(bytearray(self.seed.encode())).public_key.decode())

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v for k, v in asdict(self).items() if v is not None}, f, indent=2)
            f.write("\n")
        os.chmod(path, 0o600)


@dataclass(frozen=True)
class Identity:
    """What the server knows of a client: no secret."""

    name: str
    role: str
    nkey: str
    node: str | None = None


def inbox(name: str) -> str:
    return f"_INBOX.{name}"


def check_name(name: str, what: str = "name") -> str:
    if not NAME_RE.match(name):
        raise AuthError(
            f"{what} {name!r}: must be 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return name


def agent_name(node: str) -> str:
    return f"agent-{node}"


def new_credentials(name: str, role: str, node: str | None = None) -> Credentials:
    """A fresh key pair for `name`."""
    import nacl.signing
    import nkeys

    check_name(name)
    if role not in ROLES:
        raise AuthError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "agent":
        if node is None:
            raise AuthError("an agent identity needs its node's name")
        check_name(node, "node")
    seed = nkeys.encode_seed(bytes(nacl.signing.SigningKey.generate()), nkeys.PREFIX_BYTE_USER)
    return Credentials(name=name, role=role, seed=seed.decode(), node=node)


def load_credentials(path: str | Path) -> Credentials:
    """A `.creds` file written by `Credentials.save`. Errors never show the seed."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise AuthError(f"credentials {p}: {exc.strerror or exc}") from None
    except ValueError:
        raise AuthError(f"credentials {p}: not a Muster credentials file (JSON)") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in ("name", "role", "seed")):
        raise AuthError(f"credentials {p}: expected name, role and seed")
    role = doc["role"]
    if role not in ROLES:
        raise AuthError(f"credentials {p}: unknown role {role!r}")
    if not str(doc["seed"]).startswith("SU"):
        raise AuthError(f"credentials {p}: the seed is not an nkey user seed")
    node = doc.get("node") if isinstance(doc.get("node"), str) else None
    return Credentials(name=check_name(doc["name"]), role=role, seed=doc["seed"], node=node)


def from_env() -> Credentials | None:
    """The credentials named by MUSTER_CREDENTIALS, if set."""
    path = os.environ.get(CREDENTIALS_ENV)
    return load_credentials(path) if path else None


# ---------------------------------------------------------------- permissions

STREAMS = (
    subjects.SUBMISSIONS_STREAM,
    subjects.EVENTS_STREAM,
    subjects.COMMANDS_STREAM,
    subjects.LOGS_STREAM,
    subjects.METRICS_STREAM,
)


def kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _read(stream: str) -> list[str]:
    """Look a stream up, read its messages and consume it through consumers of any name."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.DELETE.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _bucket(bucket: str, write: bool) -> list[str]:
    rights = _read(kv(bucket))
    if write:
        rights += [f"$KV.{bucket}.>", f"$JS.API.STREAM.PURGE.{kv(bucket)}"]
    return rights


def _lookup_all() -> list[str]:
    """Stream info of every Muster stream and bucket: how a client checks Muster is set up."""
    buckets = subjects.BUCKETS
    return [f"$JS.API.STREAM.INFO.{s}" for s in STREAMS] + [f"$JS.API.STREAM.INFO.{kv(b)}" for b in buckets]


def permissions(ident: Identity | Credentials) -> dict[str, Any]:
    """The server-side publish/subscribe allow-lists of one identity."""
    name, role = ident.name, ident.role
    own_inbox = f"{inbox(name)}.>"
    ev = subjects.EVENTS_PREFIX
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "user":
        return {
            "publish": {
                "allow": [subjects.submit(name), subjects.kill_request(name), subjects.api(name, ">")]
            },
            "subscribe": {"allow": [own_inbox, subjects.verdict(name, ">")]},
        }
    if role == "agent":
        if ident.node is None:
            raise AuthError(f"agent identity {name!r} has no node")
        return _agent(own_inbox, ident.node, subjects.agent_consumer(ident.node))
    if role == "sim":
        # Every node ("*" in each node token) and its orders through consumers of any name (the
        # sim process's multi-filter ones); never as the platform, the supervisor's token.
        rights = _agent(own_inbox, "*", "*")
        rights["publish"]["allow"].append(f"$JS.API.CONSUMER.CREATE.{subjects.COMMANDS_STREAM}.*")
        rights["publish"]["deny"] = [subjects.task_event("*", "*", "*", "*", "*", subjects.PLATFORM)]
        return rights
    lookup = _lookup_all()
    if role == "validator":
        publish = [
            *lookup,
            *_read(subjects.SUBMISSIONS_STREAM),
            *_bucket(subjects.JOBS_BUCKET, write=True),
            *_bucket(subjects.JOB_NAMES_BUCKET, write=True),
            *_bucket(subjects.SECRETS_BUCKET, write=True),
            *_bucket(subjects.VCS_BUCKET, write=False),
            *_bucket(subjects.DATASETS_BUCKET, write=False),
            f"{ev}.submission.>",
            f"{ev}.job.>",
        ]
    elif role == "scheduler":
        publish = [
            *lookup,
            *_bucket(subjects.NODES_BUCKET, write=False),
            *_bucket(subjects.JOBS_BUCKET, write=True),
            *_bucket(subjects.ATTEMPTS_BUCKET, write=True),
            *_bucket(subjects.LEASES_BUCKET, write=True),
            *_bucket(subjects.SECRETS_BUCKET, write=False),
            *_bucket(subjects.VCS_BUCKET, write=False),
            subjects.assign("*"),
            subjects.kill("*"),
            f"{ev}.job.>",
            subjects.attempt_members("*", "*"),
            subjects.QUEUE,  # the waiting queue's order, for the gateway
        ]
        return {"publish": {"allow": publish}, "subscribe": {"allow": [own_inbox, subjects.beat("*")]}}
    elif role == "registry":
        publish = [
            *lookup,
            *_read(subjects.EVENTS_STREAM),
            *_bucket(subjects.RENDEZVOUS_BUCKET, write=True),
            *_bucket(subjects.ATTEMPTS_BUCKET, write=False),
            subjects.cluster_spec("*", "*"),
        ]
    elif role == "supervisor":
        publish = [
            *lookup,
            *_read(subjects.EVENTS_STREAM),
            *_read(subjects.SUBMISSIONS_STREAM),
            *_bucket(subjects.JOBS_BUCKET, write=True),
            *_bucket(subjects.JOB_NAMES_BUCKET, write=True),
            *_bucket(subjects.ATTEMPTS_BUCKET, write=True),
            *_bucket(subjects.NODES_BUCKET, write=True),
            *_bucket(subjects.RENDEZVOUS_BUCKET, write=True),
            *_bucket(subjects.SECRETS_BUCKET, write=True),
            f"$JS.API.STREAM.PURGE.{subjects.LOGS_STREAM}",
            f"$JS.API.CONSUMER.DELETE.{subjects.COMMANDS_STREAM}.>",
            subjects.kill("*"),
            f"{ev}.job.>",
            subjects.task_event("*", "*", "*", "*", "*", subjects.PLATFORM),
            subjects.attempt_members("*", "*"),
            subjects.alive("*"),  # is a silent node's agent still connected? (it answers)
        ]
        return {"publish": {"allow": publish}, "subscribe": {"allow": [own_inbox, subjects.beat("*")]}}
    elif role == "gateway":
        publish = [
            *lookup,
            *_read(subjects.LOGS_STREAM),
            *_read(subjects.METRICS_STREAM),
            f"$JS.API.DIRECT.GET.{subjects.EVENTS_STREAM}.{ev}.submission.>",
            # A job's history: consumers on MUSTER_EVENTS (its job events), read-only.
            *_read(subjects.EVENTS_STREAM),
            *_bucket(subjects.JOBS_BUCKET, write=False),
            *_bucket(subjects.JOB_NAMES_BUCKET, write=False),
            *_bucket(subjects.ATTEMPTS_BUCKET, write=False),
            *_bucket(subjects.NODES_BUCKET, write=False),
            *_bucket(subjects.VCS_BUCKET, write=False),
        ]
        return {
            "publish": {"allow": publish},
            # Questions; the scheduler's queue order (places in the queue); nodes' beats (lost).
            "subscribe": {"allow": [own_inbox, subjects.api("*", "*"), subjects.QUEUE, subjects.beat("*")]},
            "allow_responses": {"max": 1, "expires": "1m"},
        }
    else:
        raise AuthError(f"unknown role {role!r}")
    return {"publish": {"allow": publish}, "subscribe": {"allow": [own_inbox]}}


def _agent(own_inbox: str, node: str, consumer: str) -> dict[str, Any]:
    """An agent's rights on `node`, its orders through the consumer `consumer` ("*" in both:
    every node, any consumer)."""
    cmd = subjects.COMMANDS_STREAM
    api = "$JS.API"
    events, nodes_kv, attempts_kv = (
        subjects.EVENTS_STREAM,
        subjects.NODES_BUCKET,
        subjects.ATTEMPTS_BUCKET,
    )
    publish = [
        f"$KV.{nodes_kv}.{node}",
        subjects.beat(node),
        subjects.task_event("*", "*", "*", "*", "*", node),
        subjects.node_event(node, ">"),
        subjects.task_logs("*", "*", "*", "*", node),
        subjects.task_metrics("*", "*", "*", "*", node),
        *_lookup_all(),
        # Attempt records (placements and states, no job specs) to recover after a restart: read
        # by key or listed through a consumer of its own, never another's deleted. Nothing an
        # agent wrote itself may be read back through a direct get (its node record, its
        # endpoint reports): the server sends a direct get's bytes to whatever reply subject the
        # asker names, unchecked, so an agent could publish any bytes it wrote anywhere, a
        # JetStream API request included (docs/security.md).
        *(r for r in _read(kv(attempts_kv)) if ".CONSUMER.DELETE." not in r and ".DURABLE." not in r),
        # Datasets (operators' records) a job mounts, read at launch by name.
        f"{api}.DIRECT.GET.{kv(subjects.DATASETS_BUCKET)}.$KV.{subjects.DATASETS_BUCKET}.*",
        f"{api}.STREAM.INFO.{kv(subjects.DATASETS_BUCKET)}",
        # Cluster specs (peers' addresses: the registry's words).
        f"{api}.DIRECT.GET.{events}.{subjects.cluster_spec('*', '*')}",
        # Its own orders, through its own durable consumer only.
        f"{api}.CONSUMER.CREATE.{cmd}.{consumer}.{subjects.node_commands(node)}",
        f"{api}.CONSUMER.INFO.{cmd}.{consumer}",
        f"{api}.CONSUMER.MSG.NEXT.{cmd}.{consumer}",
        f"$JS.ACK.{cmd}.{consumer}.>",
    ]
    # MPI: ask a peer's agent to start a daemon in its task, and answer such asks, as `node`
    # (the peer checks that the attempt's launcher runs on the sending node).
    publish += [subjects.exec_request("*", node), subjects.exec_reply("*", node)]
    # Cluster specs as they are published (only the registry may publish them); asks and
    # answers addressed to this node.
    subscribe = [
        own_inbox,
        subjects.cluster_spec("*", "*"),
        subjects.exec_request(node, "*"),
        subjects.exec_reply(node, "*"),
        subjects.alive(node),  # the supervisor asking whether it is still there: it answers
    ]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": subscribe},
        "allow_responses": {"max": 1, "expires": "1m"},
    }


def authorization(identities: list[Identity]) -> dict[str, Any]:
    """The server config's `authorization` block."""
    users = []
    for i in identities:
        rights = permissions(i)
        for side in ("publish", "subscribe"):
            rights[side]["allow"] = sorted(set(rights[side]["allow"]))
        users.append({"nkey": i.nkey, "permissions": rights})
    return {"users": users}


# ---------------------------------------------------------------- the auth directory


class AuthDir:
    """An auth directory: the identities, their credentials, and the server's auth.conf."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()

    @property
    def registry(self) -> Path:
        return self.path / "identities.json"

    @property
    def server_config(self) -> Path:
        return self.path / "auth.conf"

    def creds(self, name: str) -> Path:
        return self.path / "creds" / f"{check_name(name)}.creds"

    def identities(self) -> list[Identity]:
        if not self.registry.exists():
            return []
        doc = json.loads(self.registry.read_text())
        return [Identity(**entry) for entry in doc.get("identities", [])]

    def get(self, name: str) -> Identity | None:
        return next((i for i in self.identities() if i.name == name), None)

    def _save(self, identities: list[Identity]) -> None:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        doc = {"identities": [{k: v for k, v in asdict(i).items() if v is not None} for i in identities]}
        tmp = self.registry.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(self.registry)
        conf = self.server_config.with_suffix(".tmp")
        conf.write_text(
            "# Generated by Muster from identities.json: do not edit (`muster admin user` changes it).\n"
            "authorization: " + json.dumps(authorization(identities), indent=2) + "\n"
        )
        os.chmod(conf, 0o600)
        conf.replace(self.server_config)

    def add(self, name: str, role: str, node: str | None = None, replace: bool = False) -> Credentials:
        """A new identity (or, with `replace`, new keys for an existing one: rotation). Writes
        its credentials file and regenerates auth.conf; the server must reload to see it."""
        creds = new_credentials(name, role, node)
        others = [i for i in self.identities() if i.name != name]
        if not replace and len(others) != len(self.identities()):
            raise AuthError(f"identity {name!r} exists (rotate its keys instead)")
        creds.save(self.creds(name))
        self._save([*others, Identity(name=name, role=role, nkey=creds.public_key, node=node)])
        return creds

    def remove(self, name: str) -> None:
        identities = self.identities()
        if not any(i.name == name for i in identities):
            raise AuthError(f"no identity {name!r}")
        self._save([i for i in identities if i.name != name])
        self.creds(name).unlink(missing_ok=True)

    def ensure(self, name: str, role: str, node: str | None = None) -> Credentials:
        """The identity's credentials, created if missing (or if its file was lost)."""
        known, path = self.get(name), self.creds(name)
        if known is not None and path.exists() and known.role == role and known.node == node:
            creds = load_credentials(path)
            if creds.public_key == known.nkey:
                return creds
        return self.add(name, role, node, replace=True)

    def ensure_services(self) -> dict[str, Credentials]:
        return {name: self.ensure(name, name) for name in SERVICES}
