"""Backend registry: the partitioners each ``conf/backend/*.yaml`` option selects.

A backend is one YAML file plus one entry here. Partitioners are built lazily so importing this
module does not pull in every backend's dependencies.
"""

from __future__ import annotations

from typing import Any, Callable

PartitionerFactory = Callable[[], list[Any]]

PARTITIONERS: dict[str, PartitionerFactory] = {}


def register_partitioner(name: str) -> Callable[[PartitionerFactory], PartitionerFactory]:
    def wrap(fn: PartitionerFactory) -> PartitionerFactory:
        PARTITIONERS[name] = fn
        return fn

    return wrap


@register_partitioner("none")
def no_partitioner() -> list[Any]:
    """Portable: every op runs on ExecuTorch's portable kernels."""
    return []


@register_partitioner("xnnpack")
def xnnpack_partitioner() -> list[Any]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


def partitioners(name: str) -> list[Any]:
    return PARTITIONERS[name]()
