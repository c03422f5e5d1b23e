"""The tests' own PostgreSQL server: `initdb` in a temporary folder, `pg_ctl start` on a free 127.0.0.1 port, stopped
by the PID in its postmaster.pid. Under root (CI) the server runs as `nobody`, since initdb and postgres refuse root.

Roles: `amp` (superuser, trusted from 127.0.0.1: the tests' own URLs carry no password) and any role a test creates
with a password (scram-sha-256 from 127.0.0.1).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

BIN = Path(os.environ.get("AMP_LAB_PG_BIN", "/usr/lib/postgresql/15/bin"))
SUPERUSER = "amp"
HBA = f"""host all {SUPERUSER} 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


def missing() -> str:
    """Why no cluster can be started here ('' when one can)."""
    absent = [name for name in ("initdb", "pg_ctl", "postgres") if not (BIN / name).exists()]
    if absent:
        return (f"PostgreSQL server binaries not found in {BIN} ({', '.join(absent)}); install Debian's `postgresql` "
                "package or set AMP_LAB_PG_BIN")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e .[postgres])"
    return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """A running server of the tests' own; `stop()` and `start()` again (same data, same port) for outage tests."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="amp-lab-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self._as = {}
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            nobody = pwd.getpwnam("nobody")
            self._as = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
            os.chown(self.folder, nobody.pw_uid, nobody.pw_gid)
        self._run(BIN / "initdb", "-D", self.data, "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync")
        (self.data / "pg_hba.conf").write_text(HBA)
        self.start()

    def _run(self, *command) -> None:
        done = subprocess.run([str(part) for part in command], capture_output=True, text=True, check=False,
                              env={**os.environ, "HOME": str(self.folder)}, cwd=self.folder, timeout=120, **self._as)
        if done.returncode:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.folder} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        self._run(BIN / "pg_ctl", "-D", self.data, "-l", self.folder / "server.log", "-w", "-t", "60", "-o", options,
                  "start")

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def stop(self) -> None:
        """Fast shutdown by PID (SIGINT to the postmaster), then wait until it is gone."""
        pid = self.pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    def url(self, database: str = "postgres", user: str = SUPERUSER, password: str | None = None) -> str:
        secret = f":{password}" if password else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(statement)

    def new_database(self) -> str:
        """A fresh, empty database's name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE {name}")
        return name

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
