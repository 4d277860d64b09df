"""Cluster self-check, run by the rendered hetjob in place of the RL roles.

Every task prints its RoleEnv; trainer rank 0 listens on its node's address and each generator
connects to it over TCP. A pass proves the components started on their nodes, read their topology
from Slurm, and can reach trainer rank 0 — what the weight-sync rendezvous needs later.
"""

import json
import os
import socket
import sys
import time
from dataclasses import asdict

from rltools.config import load_config
from rltools.launch.role_env import RoleEnv
from rltools.paths import RunPaths

DEADLINE_S = 120.0


def main(run_dir: str) -> int:
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    print("selfcheck roleenv " + json.dumps(asdict(env), sort_keys=True), flush=True)
    if env.role == "trainer" and env.rank == 0:
        expected = load_config(paths.config).cluster.generators.ntasks
        serve(env, paths, expected)
    elif env.role == "generator":
        connect(env, paths)
    return 0


def serve(env: RoleEnv, paths: RunPaths, expected: int) -> None:
    server = socket.create_server((socket.gethostbyname(env.trainer_host), 0))
    server.settimeout(DEADLINE_S)
    host, port = server.getsockname()[:2]
    tmp = paths.selfcheck_address.with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": host, "port": port, "job_id": env.job_id, "restart": env.restart_count}))
    os.replace(tmp, paths.selfcheck_address)
    print(f"selfcheck trainer rank 0 listening on {host}:{port}, expecting {expected} generator(s)", flush=True)
    for _ in range(expected):
        try:
            conn, peer = server.accept()
        except TimeoutError:
            raise SystemExit(f"selfcheck: no generator connected to {host}:{port} within {DEADLINE_S:.0f} s") from None
        with conn:
            hello = json.loads(conn.makefile().readline())
            conn.sendall(f"{env.node}\n".encode())
        print(f"selfcheck met generator rank {hello['rank']} from node {hello['node']} ({peer[0]})", flush=True)


def connect(env: RoleEnv, paths: RunPaths) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        address = _read_address(paths, env)
        if address:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"selfcheck: trainer rank 0 never published {paths.selfcheck_address} within {DEADLINE_S:.0f} s")
        time.sleep(0.5)
    # Connect by the host name RoleEnv derived from the trainer component's node list: this is the
    # lookup the weight-sync rendezvous relies on.
    with socket.create_connection((env.trainer_host, address["port"]), timeout=DEADLINE_S) as conn:
        conn.sendall((json.dumps({"rank": env.rank, "node": env.node}) + "\n").encode())
        trainer_node = conn.makefile().readline().strip()
    print(f"selfcheck met trainer rank 0 on node {trainer_node} at {env.trainer_host}:{address['port']}", flush=True)


def _read_address(paths: RunPaths, env: RoleEnv) -> dict | None:
    try:
        address = json.loads(paths.selfcheck_address.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    fresh = address["job_id"] == env.job_id and address["restart"] == env.restart_count
    return address if fresh else None  # a file left by an earlier job must not be trusted


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
