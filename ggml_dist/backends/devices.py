"""Device kinds: the name a run gives a device, and how a backend of that kind is opened from data.

    DeviceKind          the closed set of kinds: CPU (backends/cpu), ACCEL (backends/accel.py: the fake
                        accelerator of the tests, CPU kernels behind a non-host buffer type)
    DeviceSpec          a kind and its BackendOptions: what a stage's spec carries by value
    open_backend(spec, name) -> Backend    ggml_backend_dev_init: the device made, its backend created
                                           with the options mapped onto the device's own
    kind_info(spec, name) -> DeviceInfo    the kind described without opening it (what placement sizes a
                                           stage with before its process exists)
    ray_resources(kind)                    what a stage of that kind reserves besides its CPUs and memory

A new device (backends/cuda/) is its directory, a member of DeviceKind and a row of _KINDS; nothing
above backends/ names a device class.
"""
from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .accel import AccelDevice
from .base import Backend, BackendOptions, DeviceInfo, DeviceType, OpTable
from .cpu import threads as kernel_threads
from .cpu.backend import CPU_OPS, CPUDevice
from .cpu.ops import NUMBA_DEFAULT, ComputeOptions


class DeviceKind(enum.Enum):
    CPU = "cpu"
    ACCEL = "accel"


@dataclass(frozen=True)
class DeviceSpec:
    """A device by value: its kind and the options its backend is created with."""
    kind: DeviceKind = DeviceKind.CPU
    options: BackendOptions = field(default_factory=BackendOptions)


def cpu_options(opts: BackendOptions) -> ComputeOptions:
    """The CPU backend's options for a run's BackendOptions (the compiled kernels where numba is)."""
    return ComputeOptions(exact=opts.exact, numba=opts.compiled and NUMBA_DEFAULT, batch_invariant=opts.batch_invariant)


def _host_threads(n: int) -> None:
    """Kernel threads of this process (the CPU kernels'; numba's OpenMP layer reads OMP_NUM_THREADS when
    it starts). 0: as they are."""
    if n <= 0:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    try:
        kernel_threads.set_threads(n)
    except (ImportError, ValueError):      # no numba, or more threads than its pool: the default
        pass


def _open_cpu(name: str, opts: BackendOptions) -> Backend:
    _host_threads(opts.n_threads)
    return CPUDevice(name).init_backend(opts=cpu_options(opts))


def _open_accel(name: str, opts: BackendOptions) -> Backend:
    _host_threads(opts.n_threads)
    return AccelDevice(name).init_backend(opts=cpu_options(opts))


@dataclass(frozen=True)
class _Kind:
    open: Callable[[str, BackendOptions], Backend]
    type: DeviceType
    op_table: OpTable
    alignment: int
    ray_resources: dict[str, float] = field(default_factory=dict)


_KINDS: dict[DeviceKind, _Kind] = {
    DeviceKind.CPU: _Kind(_open_cpu, DeviceType.CPU, CPU_OPS, CPUDevice().buft.alignment),
    # the fake accelerator's memory is the host's: it reserves no GPU (a CUDA row would: {"num_gpus": 1})
    DeviceKind.ACCEL: _Kind(_open_accel, DeviceType.GPU, AccelDevice("accel").op_table,
                            AccelDevice("accel").buft.alignment),
}


def open_backend(spec: DeviceSpec, name: str) -> Backend:
    """ggml_backend_dev_init: a backend on a new device of spec's kind, named `name`."""
    return _KINDS[spec.kind].open(name, spec.options)


def kind_info(spec: DeviceSpec, name: str) -> DeviceInfo:
    """A device of this kind as data, without opening one (its memory unknown: 0, 0)."""
    k = _KINDS[spec.kind]
    return DeviceInfo(name, k.type, (0, 0), k.alignment, 2**62, k.op_table)


def ray_resources(kind: DeviceKind) -> dict[str, float]:
    return dict(_KINDS[kind].ray_resources)
