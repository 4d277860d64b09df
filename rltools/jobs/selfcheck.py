"""Cluster self-check, run by the rendered hetjob in place of the RL roles.

Every task prints its RoleEnv; trainer rank 0 listens on its node's address and each generator
connects to it over TCP. A pass proves the components started on their nodes, read their topology
from Slurm, and can reach trainer rank 0 — what the weight-sync rendezvous needs later.
"""

import json
import socket
import sys
from dataclasses import asdict

from rltools.config import load_config
from rltools.paths import RunPaths
from rltools.runtime.address import AddressTimeout, publish_address, wait_for_address
from rltools.runtime.role_env import RoleEnv

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
    publish_address(paths.selfcheck_address, host, port, env.attempt)
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
    try:
        _, port = wait_for_address(paths.selfcheck_address, env.attempt, DEADLINE_S, "selfcheck trainer rank 0")
    except AddressTimeout as err:
        raise SystemExit(f"selfcheck: {err}") from None
    # Connect by the host name RoleEnv derived from the trainer component's node list: this is the
    # lookup the weight-sync rendezvous relies on.
    with socket.create_connection((env.trainer_host, port), timeout=DEADLINE_S) as conn:
        conn.sendall((json.dumps({"rank": env.rank, "node": env.node}) + "\n").encode())
        trainer_node = conn.makefile().readline().strip()
    print(f"selfcheck met trainer rank 0 on node {trainer_node} at {env.trainer_host}:{port}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
