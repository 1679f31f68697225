"""docker-compose.yml's one-shot `keys` service: `python deploy/docker/keys.py /keys`.

/keys/scheduler, /keys/gateway and /keys/worker are one volume each, mounted by that role's
containers alone (as deploy/k8s mounts one Secret per pod), so no container holds another role's
secret key. On first start the volumes are empty: a fresh set is made by proto.auth (proto/keyset.py's
layout) and each volume gets what its role loads (KeySet.needed_by), secret files 0600, owned by
the container's user. Later starts keep what is there. Volumes of which some are complete and
some not are left alone with an error: regenerating would lock out the roles that kept the old
set (and an operator's own keys are never overwritten).

The public side gets a key too: /keys/gateway/api-key, made once (32 random bytes, URL-safe,
0600) and printed once, when it is made; the gateway serves with it as its --api-key
(PAGODA_API_KEY, which docker-compose.yml sets from the file unless the host sets its own).
"""
from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from proto.auth import create_keys
from proto.keyset import ROLES, KeySet


def split(root: Path) -> str:
    complete = {role: not KeySet(root / role).missing(role) for role in ROLES}
    if all(complete.values()):
        return f"{root}: kept the keys already there"
    if any(complete.values()):
        missing = {r: KeySet(root / r).missing(r) for r in ROLES if not complete[r]}
        raise SystemExit(f"{root}: the key volumes disagree (missing {missing}); remove all three "
                         "(docker compose down -v) or put a matching set in each")
    with tempfile.TemporaryDirectory() as tmp:
        made = KeySet(create_keys(Path(tmp) / "set"))
        for role in ROLES:
            target = root / role
            target.mkdir(mode=0o700, parents=True, exist_ok=True)
            for path in made.needed_by(role):
                dest = target / path.relative_to(made.root)
                dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                if path.is_dir():
                    shutil.copytree(path, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(path, dest)  # keeps 0600 on the secret files
    return f"{root}: made a key set, one role per volume"


API_KEY_FILE = "api-key"


def api_key(gateway: Path) -> str:
    """Makes the gateway's API key unless it has one; says so, with the key only when made."""
    path = gateway / API_KEY_FILE
    if path.exists():
        return f"{path}: kept the API key already there (docker compose exec -T gateway cat /keys/{API_KEY_FILE})"
    key = secrets.token_urlsafe(32)
    gateway.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return (f"{path}: made the gateway's API key; it is printed this once, send it as "
            f"`authorization: Bearer <key>`:\n{key}")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/keys")
    print(split(root))
    print(api_key(root / "gateway"))
