"""Which host paths a job may mount: its dir fields (dataDir, codeDir, outputDir) and authFile
must lie under one of the configured roots, else they are refused, never mounted.

`MUSTER_DATA_ROOTS` is a comma-separated list of absolute directories; `{user}` in one stands
for the submitting user's name (`/data/{user}` gives each user a root of their own). Unset, an
agent allows only `<its data dir>/users/{user}` (the parent of its work root): each user's own
directory, nothing shared. An unset outputDir is the platform's own choice (`<output root>/
<jobName>`) and needs no root; an outputDir a job names must lie under one. `muster up` adds
the directory it was started in, so a config next to its code (`"codeDir": "./"`) works out of
the box. The validator checks only when MUSTER_DATA_ROOTS is set (it cannot know an agent's
default). `/` is never a root: it would let a job mount the Docker socket or /etc.

A user name that could step out of a `{user}` root (empty, `.`, `..`, containing `/`) gets no
`{user}` root at all.

Checked twice:
- at validation, lexically, when the validator has roots configured: relative paths, `..`
  components and paths outside every root are refused with the field's name;
- at launch, on the node, after resolving symlinks (a link out of a root is caught here): a
  configuration error, so the job fails at once and nothing is mounted. A root that is itself a
  symlink allows nothing (its owner could point it anywhere); links above it are followed.

What is left: a user with a shell on the node who can write under a root could swap a checked
directory for a link between the check and the engine's mount (a race of milliseconds, the
engine follows links when it mounts). Where users have such access, make the roots writable
only through jobs (or by the operator).
"""

from __future__ import annotations

import os
import posixpath

from muster.shared.jobconfig import FieldError, JobConfig

DIR_FIELDS = ("dataDir", "codeDir", "outputDir", "authFile")
USER = "{user}"


class RootsError(ValueError):
    """MUSTER_DATA_ROOTS (or --data-roots) cannot be used; the message names the bad entry."""


def parse_roots(text: str) -> list[str]:
    roots = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if not entry.startswith("/"):
            raise RootsError(f"data root {entry!r}: must be an absolute path")
        normal = "/" + posixpath.normpath(entry).lstrip("/")  # normpath keeps a leading "//"
        if normal == "/":
            raise RootsError("data root '/': would let a job mount the whole host (the Docker socket, /etc)")
        if ".." in entry.split("/"):
            raise RootsError(f"data root {entry!r}: no '..' components")
        roots.append(normal)
    return roots


def roots_for(roots: list[str], user: str) -> list[str]:
    """The roots of one user: `{user}` filled in (roots with `{user}` dropped for a name that is
    not a single path component)."""
    usable = bool(user) and "/" not in user and user not in (".", "..") and "\0" not in user
    return [r.replace(USER, user) for r in roots if usable or USER not in r]


def local(path: str | None) -> str | None:
    """A host path from a dir field: an absolute path or a file:// URI; None for other URIs
    (hdfs://, s3://: not host paths, nothing to mount)."""
    if not path:
        return None
    if path.startswith("file://"):
        path = path[len("file://") :]
    if "://" in path:
        return None
    return path


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def lexical_problem(path: str, roots: list[str]) -> str | None:
    """Why `path` may not be mounted, judged without the filesystem (None: it may). A file://
    URI is its path; another URI (hdfs://, s3://) is no host path and passes."""
    if "://" in path:
        found = local(path)
        if found is None:
            return None
        path = found
    if not path.startswith("/"):
        return "must be an absolute path (or ./relative to the config, with `muster submit`)"
    if ".." in path.split("/"):
        return "must not contain '..'"
    normal = "/" + posixpath.normpath(path).lstrip("/")
    if not any(under(normal, r) for r in roots):
        return f"{normal} is not under the allowed roots ({', '.join(roots) or 'none configured'})"
    return None


def resolve_under_roots(path: str, roots: list[str]) -> str:
    """`path` with every symlink resolved, if it is still under a root (roots resolved too);
    raises ValueError saying why not. Only for host paths: a URI other than file:// is refused."""
    host = local(path)
    if host is None or not host.startswith("/"):
        raise ValueError(f"{path}: not an absolute host path")
    path = host
    why = lexical_problem(path, roots)
    if why:
        raise ValueError(why)
    real = os.path.realpath(path)
    # A root's own parents may be links an operator made (/data -> /mnt/disk); the root itself
    # may not: a user owning /data/users/alice could make it a link to /etc.
    real_roots = [os.path.realpath(r) for r in roots if not os.path.islink(r)]
    real_roots = [r for r in real_roots if r != "/"]
    if not any(under(real, r) for r in real_roots):
        raise ValueError(f"{path} resolves to {real}, outside the allowed roots ({', '.join(roots)})")
    return real


def expand(value: str | None, config: JobConfig, user: str) -> str | None:
    """$PAI_USERNAME and $PAI_JOB_NAME (or ${...}) expanded, as the agent does."""
    if not value:
        return value
    for name, sub in (("PAI_USERNAME", user), ("PAI_JOB_NAME", config.jobName)):
        value = value.replace("${" + name + "}", sub).replace("$" + name, sub)
    return value


def check_dirs(config: JobConfig, user: str, roots: list[str]) -> list[FieldError]:
    """The dir fields (and authFile) that can be known at validation and are not allowed.
    A field still holding another `$VARIABLE` once expanded is left for launch."""
    errors = []
    mine = roots_for(roots, user)
    for field in DIR_FIELDS:
        value = expand(getattr(config, field), config, user)
        path = local(value)
        if path is None or "$" in path:
            continue
        why = lexical_problem(path, mine)
        if why:
            errors.append(FieldError(path=field, reason=why))
    # A local repository for codeSync (a path or file://) is read from the host like a dir field.
    source = config.codeSync.git if config.codeSync else None
    if source and (source.startswith("/") or source.lower().startswith("file://")):
        why = lexical_problem(source[len("file://") :] if "://" in source else source, mine)
        if why:
            errors.append(FieldError(path="codeSync.git", reason=why))
    return errors
