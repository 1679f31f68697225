"""A cluster's CURVE keys on disk: the layout, what each role needs of it, and its creation.

    <dir>/scheduler.key, scheduler.key_secret   the CURVE server: the scheduler's two sockets
    <dir>/gateway.key, gateway.key_secret       a gateway's key pair
    <dir>/worker.key, worker.key_secret         a worker's key pair
    <dir>/authorized/gateway/*.key              public keys the gateway socket (5555) accepts
    <dir>/authorized/worker/*.key               public keys the worker socket (5556) accepts

A key is bound to the role whose folder holds it: a gateway's key never registers a worker, a
worker's never adds a request. Several gateways or workers may each have a key pair of their own
(each host keeps its pair under the role's file names; the scheduler's folder gets one public
key per host, any file name ending .key). The scheduler reads the folders at start. Secret files
are 0600, the directory 0700.

A set is made in a fresh directory beside the target and renamed onto it in one step, so a
concurrent reader (a second launcher, a test) finds either no set or a complete one.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

SERVER = "scheduler"
CLIENTS = ("gateway", "worker")
ROLES = (SERVER, *CLIENTS)


@dataclass(frozen=True)
class KeySet:
    root: Path

    def public(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def authorized(self, role: str) -> Path:
        return self.root / "authorized" / role

    def needed_by(self, role: str) -> list[Path]:
        """The paths a process of this role loads (a pod's Secret holds just these)."""
        if role == SERVER:
            return [self.public(SERVER), self.secret(SERVER), *map(self.authorized, CLIENTS)]
        if role in CLIENTS:
            return [self.secret(role), self.public(SERVER)]
        raise ValueError(f"no role {role!r}: one of {', '.join(ROLES)}")

    def missing(self, role: str | None = None) -> list[str]:
        """What is absent, relative to the root: for one role, or (None) for a whole set."""
        wanted = self.needed_by(role) if role else [
            *(p for name in ROLES for p in (self.public(name), self.secret(name))),
            *(self.authorized(c) / f"{c}.key" for c in CLIENTS)]
        return [str(p.relative_to(self.root)) for p in wanted if not p.exists()]

    def create(self) -> "KeySet":
        """A fresh set at root, unless a complete one is there already (kept, never remade)."""
        if not self.missing():
            return self
        self.root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.root.name}.", dir=self.root.parent))
        try:
            KeySet(staging)._write()
            try:
                # rename replaces a missing or empty directory, and refuses a full one: the first
                # of several creators wins and the others use its set.
                os.rename(staging, self.root)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if missing := self.missing():
            raise SystemExit(f"{self.root} holds files but not a complete CURVE key set (missing "
                             f"{', '.join(missing)}; sets made before keys were bound to roles had "
                             f"one authorized/ folder): move it aside and run python -m proto.auth "
                             f"{self.root} to make a new set")
        return self

    def _write(self) -> None:
        # Only into a private staging directory (0700, from mkdtemp): no one can open a secret
        # file in the moment between its creation and its chmod.
        for name in ROLES:
            public, secret = zmq.auth.create_certificates(str(self.root), name)
            os.chmod(secret, 0o600)
            if name in CLIENTS:
                self.authorized(name).mkdir(parents=True)
                shutil.copyfile(public, self.authorized(name) / f"{name}.key")
