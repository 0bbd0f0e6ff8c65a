"""Sweeps over a partition's configuration space on the simulator (what `kareus sim sweep` prints).

A sweep target is a partition type (`fwd_attn`), the same work executed Megatron-style
(`sequential:fwd_attn`, reported per nanobatch so it compares directly with the partition), or one
whole transformer layer's forward pass Megatron-style (`sequential:layer`, whole microbatch). For
partitions every (clock, comm SMs, launch slot) is measured; sequential targets have no SM count
or slot (both null).

Ranges are inclusive `start:stop[:step]` strings (`900:1410:30`, `1:30`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.errors import KareusError
from kareus.sim.gpus import GPUSpec
from kareus.sim.measurement import Measurement
from kareus.sim.simulator import Simulator
from kareus.workload.ops import LayerDims, layer_sequential_forward
from kareus.workload.partitions import PartitionType, Workload

SEQUENTIAL_PREFIX = "sequential:"
LAYER_TARGET = "sequential:layer"


def parse_range(text: str, field: str = "range") -> tuple[int, ...]:
    """Inclusive integer range `start:stop[:step]` (a single number is a one-element range)."""
    parts = text.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        raise KareusError(f"{field}: expected start:stop[:step] with integers, got {text!r}") from None
    if len(numbers) == 1:
        numbers = [numbers[0], numbers[0]]
    if len(numbers) not in (2, 3):
        raise KareusError(f"{field}: expected start:stop[:step], got {text!r}")
    start, stop = numbers[0], numbers[1]
    step = numbers[2] if len(numbers) == 3 else 1
    if step <= 0:
        raise KareusError(f"{field}: step must be a positive integer, got {step}")
    if start > stop:
        raise KareusError(f"{field}: start {start} must be <= stop {stop}")
    return tuple(range(start, stop + 1, step))


def default_clocks(gpu: GPUSpec) -> tuple[int, ...]:
    """The paper's clock grid: max clock down in 30 MHz steps to ~64 % of it (A100: 900–1410)."""
    return gpu.search_clocks_mhz


@dataclass(frozen=True)
class SweepTarget:
    """What a sweep measures: a partition type, or sequential work (`ptype` None for a layer)."""

    name: str
    ptype: PartitionType | None
    sequential: bool


def resolve_target(workload: Workload, name: str) -> SweepTarget:
    if name == LAYER_TARGET:
        return SweepTarget(name, None, True)
    sequential = name.startswith(SEQUENTIAL_PREFIX)
    type_name = name[len(SEQUENTIAL_PREFIX):] if sequential else name
    if type_name not in workload.partition_types:
        known = [*workload.partition_types, *(SEQUENTIAL_PREFIX + n for n in workload.partition_types), LAYER_TARGET]
        raise KareusError(f"--partition: unknown partition {name!r}; allowed: {', '.join(known)}")
    return SweepTarget(name, workload.partition_types[type_name], sequential)


def resolve_slots(ptype: PartitionType, requested: Sequence[str] | None) -> tuple[str, ...]:
    """`None` or `all` → the type's launch slots; otherwise each name must be a slot of the type."""
    if not requested or list(requested) == ["all"]:
        return ptype.launch_slots
    slots = tuple(dict.fromkeys(requested))
    for slot in slots:
        if slot not in ptype.slots:
            raise KareusError(f"--slots: {slot!r} is not a slot of {ptype.name}; allowed: "
                              f"{', '.join(ptype.launch_slots)} (or all)")
    return slots


def point(target: str, clock_mhz: int, comm_sms: int | None, launch_slot: str | None,
          measurement: Measurement) -> dict[str, Any]:
    """One result row: the configuration and everything the measurement reports."""
    return {"partition": target, "clock_mhz": clock_mhz, "comm_sms": comm_sms, "launch_slot": launch_slot,
            **measurement.to_dict()}


def sweep(simulator: Simulator, workload: Workload, target_name: str, *, clocks_mhz: Sequence[int],
          comm_sms: Sequence[int] | None = None, slots: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Measure every configuration of `target_name`; yields `point` rows (clock-major order)."""
    gpu = simulator.gpu
    for clock in clocks_mhz:
        if not gpu.clock_min_mhz <= clock <= gpu.clock_max_mhz:
            raise KareusError(f"--clocks: {clock} MHz outside {gpu.name}'s {gpu.clock_min_mhz}..{gpu.clock_max_mhz}")
    target = resolve_target(workload, target_name)
    if target.sequential:
        layer_ops = None
        if target.ptype is None:
            dims = LayerDims(workload.shape, workload.tp, workload.cp, workload.micro_batch_size,
                             workload.seq_len // workload.cp)
            layer_ops = layer_sequential_forward(dims)
        for clock in clocks_mhz:
            measured = (simulator.sequential(layer_ops, clock) if layer_ops is not None
                        else simulator.sequential_partition(target.ptype, clock))  # type: ignore[arg-type]
            yield point(target.name, clock, None, None, measured)
        return
    ptype = target.ptype
    assert ptype is not None
    sms_values = tuple(comm_sms) if comm_sms else ptype.comm_sms_grid
    for sms in sms_values:
        if not 1 <= sms < gpu.sms:
            raise KareusError(f"--sms: {sms} outside 1..{gpu.sms - 1} ({gpu.name} has {gpu.sms} SMs)")
    chosen_slots = resolve_slots(ptype, slots)
    for clock in clocks_mhz:
        for slot in chosen_slots:
            for sms in sms_values:
                yield point(target.name, clock, sms, slot, simulator.partition(ptype, clock, sms, slot))
