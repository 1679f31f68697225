"""CURVE authentication of the internal ZeroMQ sockets (zmq.auth), and the hello's version.

One keys directory serves the whole cluster:

    <dir>/scheduler.key, scheduler.key_secret    the CURVE server (the scheduler's two ROUTERs)
    <dir>/gateway.key_secret, worker.key_secret  the clients' key pairs
    <dir>/authorized/*.key                       public keys allowed to connect

A peer whose public key is not in authorized/ fails the handshake: its frames never reach the
scheduler. Without a directory a process runs unauthenticated only with --insecure, and then only
on loopback addresses.
"""
from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("pagoda.auth")

# Raised on any change of internal.proto that an older peer would misread.
PROTOCOL_VERSION = 2
SERVER = "scheduler"
CLIENTS = ("gateway", "worker")
_LOOPBACK = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://", "inproc://")


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("internal sockets")
    g.add_argument("--zmq-keys-dir", default=None,
                   help="CURVE keys of the cluster (see proto/auth.py; `make run` creates them)")
    g.add_argument("--insecure", action="store_true",
                   help="no CURVE on the internal sockets: allowed on loopback addresses only")


def create_keys(keys_dir: str | Path) -> Path:
    """A fresh key set for one cluster (kept if it already exists). Returns the directory."""
    root = Path(keys_dir)
    if (root / f"{SERVER}.key_secret").exists():
        return root
    (root / "authorized").mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    for name in (SERVER, *CLIENTS):
        public, _ = zmq.auth.create_certificates(str(root), name)
        if name != SERVER:
            shutil.copy(public, root / "authorized" / f"{name}.key")
    return root


def check_auth_args(args, *addresses: str) -> None:
    """Exit with a clear message unless the flags choose CURVE, or --insecure on loopback."""
    if args.zmq_keys_dir:
        if not (Path(args.zmq_keys_dir) / f"{SERVER}.key").exists():
            raise SystemExit(f"--zmq-keys-dir {args.zmq_keys_dir}: no {SERVER}.key there "
                             "(python -m proto.auth DIR creates a key set)")
        return
    if not args.insecure:
        raise SystemExit("the internal sockets need --zmq-keys-dir DIR (CURVE keys), "
                         "or --insecure for unauthenticated loopback")
    remote = [a for a in addresses if not a.startswith(_LOOPBACK)]
    if remote:
        raise SystemExit(f"--insecure is for loopback only, not {', '.join(remote)}")


class CurveServer:
    """The scheduler's side: one ZAP authenticator per context, its sockets CURVE servers."""

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path | None) -> None:
        self.keys_dir = Path(keys_dir) if keys_dir else None
        self.auth: ThreadAuthenticator | None = None
        if self.keys_dir is not None:
            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagoda.auth.zap"))
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(self.keys_dir / "authorized"))

    def secure(self, sock: zmq.Socket) -> None:
        if self.keys_dir is None:
            return
        public, secret = zmq.auth.load_certificate(str(self.keys_dir / f"{SERVER}.key_secret"))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


def secure_client(sock: zmq.Socket, keys_dir: str | Path | None, role: str) -> None:
    """Before connect: this role's key pair, and the scheduler's public key to check it by."""
    if not keys_dir:
        return
    root = Path(keys_dir)
    public, secret = zmq.auth.load_certificate(str(root / f"{role}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(root / f"{SERVER}.key"))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


if __name__ == "__main__":
    import sys
    print(create_keys(sys.argv[1] if len(sys.argv) > 1 else ".keys"))
