"""The resolvers the launcher presets in ``conf/hydra/launcher/`` use (``${exporters.parallel_jobs:...}``).

Registered by :func:`exporters.config.register_configs`, which the commands call before Hydra composes.
"""

from __future__ import annotations

import os

def parallel_jobs(job_memory_gb: int) -> int:
    """Jobs a machine runs at once: one per core, no more than fit in the memory available now."""
    with open("/proc/meminfo") as f:
        available_gb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 1024**2
    return max(1, min(os.cpu_count() or 1, int(available_gb // max(job_memory_gb, 1))))


# Ray puts unix sockets under <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/, and a socket path may
# not exceed 107 bytes: room for the temp dir itself.
RAY_SOCKET_SUFFIX = len("/session_2026-11-23_00-42-50_854187_1234567/sockets/plasma_store")


def ray_temp_dir(sweep_dir: str) -> str:
    """Ray's temporary folder for a sweep: ``<sweep folder>/.ray`` where its socket paths fit, else Ray's
    own default ``/tmp/ray``."""
    inside = os.path.join(os.path.abspath(sweep_dir), ".ray")
    return inside if len(inside) + RAY_SOCKET_SUFFIX <= 107 else "/tmp/ray"


def gib(gb: int) -> int:
    return int(gb) * 1024**3


RESOLVERS = {"exporters.parallel_jobs": parallel_jobs, "exporters.ray_temp_dir": ray_temp_dir, "exporters.gib": gib}
