"""How a person signs in to the web portal as their own Muster identity (docs/security.md, "The
web portal"), and the portal's session cookies. Pure: files and bytes, no bus, no web.

A **login secret** is issued with the identity (`muster admin user add NAME`, reissued by
`muster admin user login NAME`): 25 random base32 characters (125 bits), shown once. What is
stored, in `<auth dir>/logins/NAME.json`, is the identity's nkey seed *sealed* under a key derived
from the secret (scrypt, then XSalsa20-Poly1305 from PyNaCl, which nkeys already brings): the
secret itself is kept nowhere, and without it the file opens to nothing. So the portal can act on
the bus as NAME only while NAME's secret (or a session made from it) is presented: it holds no
identity of its own, and a portal that is compromised while no one is signed in has no key.

A **session** is a cookie sealed with the portal's key (`<auth dir>/portal.key`, shared by the
replicas, so any replica opens any session): the name, the role, the key derived from the secret
(so a request need not run scrypt again), when it ends and a random id from which the form token
against cross-site forgery is derived. Nothing in the cookie is readable or changeable without the
portal's key; without the sealed login file it still opens to nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from nacl.exceptions import CryptoError
from nacl.secret import SecretBox

from muster.shared.auth import AuthError, Credentials, check_name

SCRYPT = {"n": 2**14, "r": 8, "p": 1}  # ~50 ms and 16 MiB per sign-in: once, not per request
SESSION_SECONDS = 12 * 3600
KEY_BYTES = SecretBox.KEY_SIZE


class LoginRefused(Exception):
    """A sign-in or a session that is not good; the message never says which part was wrong."""


def new_secret() -> str:
    """A login secret: 25 base32 characters (125 random bits), grouped for reading aloud."""
    raw = base64.b32encode(secrets.token_bytes(20)).decode().rstrip("=").lower()[:25]
    return "-".join(raw[i : i + 5] for i in range(0, 25, 5)) if raw else raw


def _normal(secret: str) -> bytes:
    """A secret as typed: case, spaces and dashes do not matter."""
    return "".join(secret.lower().split()).replace("-", "").encode()


def derive(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(_normal(secret), salt=salt, dklen=KEY_BYTES, maxmem=64 * 1024 * 1024, **SCRYPT)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Logins:
    """The sealed logins of an auth dir, and the portal's key."""

    def __init__(self, auth_dir: str | Path):
        self.path = Path(auth_dir).absolute()

    def file(self, name: str) -> Path:
        return self.path / "logins" / f"{check_name(name)}.json"

    def issue(self, creds: Credentials) -> str:
        """A new login secret for `creds`' identity (any earlier one stops working); returns it."""
        if creds.role not in ("user", "admin"):
            raise AuthError(f"{creds.name} is a {creds.role}: only people (users, admins) sign in")
        secret = new_secret()
        salt = os.urandom(16)
        box = SecretBox(derive(secret, salt))
        doc = {
            "name": creds.name,
            "role": creds.role,
            "salt": _b64(salt),
            "sealed": _b64(bytes(box.encrypt(creds.seed.encode()))),
        }
        path = self.file(creds.name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        tmp.replace(path)
        return secret

    def remove(self, name: str) -> None:
        self.file(name).unlink(missing_ok=True)

    def _doc(self, name: str) -> dict[str, str]:
        try:
            doc = json.loads(self.file(name).read_text())
        except (OSError, ValueError, AuthError):
            raise LoginRefused("wrong name or secret") from None
        if not isinstance(doc, dict) or doc.get("name") != name:
            raise LoginRefused("wrong name or secret")
        return doc

    def key_for(self, name: str, secret: str) -> bytes:
        """The key `secret` derives for `name` if it opens NAME's login; else LoginRefused."""
        doc = self._doc(name)
        key = derive(secret, _unb64(doc["salt"]))
        self.open(name, key)
        return key

    def open(self, name: str, key: bytes) -> Credentials:
        """NAME's credentials, unsealed with a key derived from their secret."""
        doc = self._doc(name)
        try:
            seed = SecretBox(key).decrypt(_unb64(doc["sealed"])).decode()
        except (CryptoError, ValueError, KeyError, TypeError):
            raise LoginRefused("wrong name or secret") from None
        return Credentials(name=name, role=doc.get("role", "user"), seed=seed)

    def portal_key(self, create: bool = False) -> bytes:
        """The key the portal's replicas seal sessions with (made once, 0600)."""
        path = self.path / "portal.key"
        try:
            return _unb64(path.read_text().strip())
        except FileNotFoundError:
            if not create:
                raise
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        key = os.urandom(KEY_BYTES)
        with os.fdopen(fd, "w") as f:
            f.write(_b64(key) + "\n")
        return key


@dataclass(frozen=True)
class Session:
    """Who a browser is signed in as. `key`: what unseals their login (None for a session of the
    local user, whose credentials the process holds: `muster ui`, `muster up`)."""

    name: str
    role: str
    key: bytes | None
    until: float
    sid: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


class Sessions:
    """Session cookies sealed with the portal's key."""

    def __init__(self, portal_key: bytes, seconds: float = SESSION_SECONDS):
        self.box = SecretBox(portal_key)
        self.mac_key = hashlib.sha256(b"muster-portal-form-token" + portal_key).digest()
        self.seconds = seconds

    def new(self, name: str, role: str, key: bytes | None) -> tuple[Session, str]:
        session = Session(name, role, key, time.time() + self.seconds, secrets.token_urlsafe(16))
        doc = {"u": name, "r": role, "e": session.until, "s": session.sid}
        if key is not None:
            doc["k"] = _b64(key)
        return session, _b64(bytes(self.box.encrypt(json.dumps(doc).encode())))

    def open(self, cookie: str | None) -> Session:
        if not cookie or len(cookie) > 4096:
            raise LoginRefused("not signed in")
        try:
            doc = json.loads(self.box.decrypt(_unb64(cookie)))
            session = Session(
                str(doc["u"]),
                str(doc["r"]),
                _unb64(doc["k"]) if "k" in doc else None,
                float(doc["e"]),
                str(doc["s"]),
            )
        except (CryptoError, ValueError, KeyError, TypeError):
            raise LoginRefused("not signed in") from None
        if session.until < time.time():
            raise LoginRefused("the session has ended: sign in again")
        return session

    def form_token(self, session: Session) -> str:
        """The token every state-changing request of this session must carry (not in the cookie)."""
        return hmac.new(self.mac_key, session.sid.encode(), hashlib.sha256).hexdigest()[:32]

    def check_form_token(self, session: Session, token: str | None) -> bool:
        # As bytes: compare_digest refuses a str with anything but ASCII (a TypeError, a 500).
        return bool(token) and hmac.compare_digest(self.form_token(session).encode(), str(token).encode())
