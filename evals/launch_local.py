"""Launch N local processes of one command as a `jax.distributed` job on this machine.

    python -m amphista_jax.evals.launch_local -n 2 -- amphista-jax eval --config configs/eval/humaneval-code.yaml

Each process gets `JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `JAX_NUM_PROCESSES=N` and
`JAX_PROCESS_ID=i`, which `amphista_jax.train.loop.maybe_initialize_distributed` turns into `jax.distributed.initialize`
(CPU collectives: gloo, JAX's default). On a cluster, set the same three variables per host instead (or let
your scheduler's `jax.distributed` auto-detection do it); evaluation assumes every process sees `out_dir` on
one shared filesystem. Output lines are prefixed with `[i]`. Exits with the first non-zero status (or 0).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()


def launch(command: Sequence[str], num_processes: int, env: dict[str, str] | None = None) -> int:
    """Run `command` as processes 0..N-1 of one job; wait for all; return the first non-zero exit status."""
    if num_processes < 1:
        raise ValueError(f"{num_processes=} must be >= 1")
    if not command:
        raise ValueError("no command to launch: put it after `--`")
    address = f"127.0.0.1:{free_port()}"
    procs, relays = [], []
    for i in range(num_processes):
        penv = dict(env if env is not None else os.environ) | {
            "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(i)}
        p = subprocess.Popen(list(command), env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t = threading.Thread(target=_relay, args=(p.stdout, f"[{i}] "), daemon=True)
        t.start()
        procs.append(p)
        relays.append(t)
    codes = [p.wait() for p in procs]
    for t in relays:
        t.join()
    return next((c for c in codes if c != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(command, args.num_processes)


if __name__ == "__main__":
    raise SystemExit(main())
