"""CURVE authentication of the internal ZeroMQ sockets (zmq.auth), and the hello's version.

The keys directory's layout is proto/keyset.py's: the scheduler's key pair, one per client role,
and per role a folder of the public keys allowed in that role. Each of the scheduler's two
ROUTERs is a CURVE server in a ZAP domain of its own, which accepts only its role's folder: a
peer whose key is not there (a stranger, or the other role's key) fails the handshake and its
frames never reach the scheduler. Without a directory a process runs unauthenticated only with
--insecure, and then only on loopback addresses (proto/loopback.py).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from proto.keyset import CLIENTS, SERVER, KeySet
from proto.loopback import LOOPBACK_FORMS, is_loopback

__all__ = ["PROTOCOL_VERSION", "SERVER", "CLIENTS", "add_auth_args", "create_keys",
           "check_auth_args", "CurveServer", "secure_client"]

log = logging.getLogger("pagoda.auth")

# Raised on any change of internal.proto that an older peer would misread. 4: every token to a
# gateway travels in SchedulerMessage's columns, none in a TokenDelta (proto/token_stream.py).
# 5: a worker compiles grammars before their sequences are admitted (CompileGrammars).
# 7: TokenDelta has no token_ids; a worker's logprobs are SlotLogprobs (by slot), a gateway's
# Logprobs (by request and index), one message per link.
PROTOCOL_VERSION = 7


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("internal sockets")
    g.add_argument("--zmq-keys-dir", default=None,
                   help="CURVE keys of the cluster (see proto/keyset.py; `make run` creates them)")
    g.add_argument("--insecure", action="store_true",
                   help="no CURVE on the internal sockets: allowed on loopback addresses only")


def create_keys(keys_dir: str | Path) -> Path:
    """A fresh key set for one cluster (kept if it already exists). Returns the directory."""
    return KeySet(Path(keys_dir)).create().root


def check_auth_args(args, *addresses: str, role: str | None = None) -> None:
    """Exit with a clear message unless the flags choose CURVE, or --insecure on loopback. With
    a role, the keys directory must hold what that role loads."""
    if args.zmq_keys_dir:
        keys = KeySet(Path(args.zmq_keys_dir))
        if role:
            missing = keys.missing(role)
        else:  # what every role loads: the scheduler's public key
            missing = [] if keys.public(SERVER).exists() else [keys.public(SERVER).name]
        if missing:
            raise SystemExit(f"--zmq-keys-dir {args.zmq_keys_dir}: no {', '.join(missing)} there "
                             "(python -m proto.auth DIR creates a key set; see proto/keyset.py)")
        return
    if not args.insecure:
        raise SystemExit("the internal sockets need --zmq-keys-dir DIR (CURVE keys), "
                         "or --insecure for unauthenticated loopback")
    remote = [a for a in addresses if not is_loopback(a)]
    if remote:
        raise SystemExit(f"--insecure is for loopback only, not {', '.join(remote)} "
                         f"(loopback here: {LOOPBACK_FORMS})")


class CurveServer:
    """The scheduler's side: one ZAP authenticator per context, each socket a CURVE server in
    the ZAP domain of the role it serves. No domain "*" is configured: a socket secured here
    accepts its own role's keys and nothing else."""

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path | None) -> None:
        self.keys = KeySet(Path(keys_dir)) if keys_dir else None
        self.auth: ThreadAuthenticator | None = None
        if self.keys is not None:
            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagoda.auth.zap"))
            self.auth.start()

    def secure(self, sock: zmq.Socket, role: str) -> None:
        """Before bind: this socket accepts only keys in authorized/<role>/."""
        if role not in CLIENTS:
            raise ValueError(f"a scheduler socket serves one of {', '.join(CLIENTS)}, not {role!r}")
        if self.keys is None:
            return
        folder = self.keys.authorized(role)
        if not folder.is_dir():  # configure_curve would only log it, and then refuse everyone
            raise SystemExit(f"--zmq-keys-dir {self.keys.root}: no authorized/{role}/ folder "
                             "(see proto/keyset.py)")
        count = len(zmq.auth.load_certificates(str(folder)))
        if count:
            log.info("%s socket: %d authorized key(s) in %s", role, count, folder)
        else:
            log.warning("%s socket: no key in %s, so no %s can connect", role, folder, role)
        self.auth.configure_curve(domain=role, location=str(folder))
        public, secret = zmq.auth.load_certificate(str(self.keys.secret(SERVER)))
        sock.zap_domain = role.encode()
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
    if role not in CLIENTS:
        raise ValueError(f"a client of the scheduler is one of {', '.join(CLIENTS)}, not {role!r}")
    keys = KeySet(Path(keys_dir))
    public, secret = zmq.auth.load_certificate(str(keys.secret(role)))
    server_public, _ = zmq.auth.load_certificate(str(keys.public(SERVER)))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


if __name__ == "__main__":
    import sys
    print(create_keys(sys.argv[1] if len(sys.argv) > 1 else ".keys"))
