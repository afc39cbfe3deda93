"""A fake accelerator for tests: host numpy memory that presents itself as a non-host GPU.

The scheduler only asks a device what it supports ("supports op", "supports buffer type", "is host",
"offload op"), so a CPU device with its own non-host buffer type and a configurable op set reproduces
every placement case of ggml-mechanisms.md §5.3 (fake "GPU" devices), while its kernels are the CPU ones,
so results can be compared bit for bit with the reference executor.

Two modes:
  * default: its own buffer type (is_host False). Tensors of other backends reach it only through split
    input copies, as with a real GPU.
  * shares_cpu_buft=True: the "BLAS-like" accelerator of §5.3 S-2. Its default buffer type is the CPU's
    (the same object, so pass 3's upgrade rule `bufts[b] == bufts[c]` can fire) and it reads any host
    buffer, so it never needs copies.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..core.tensor import VIEW_OPS, Op, Tensor
from .base import BufferType, Device, DeviceType, OpTable
from .cpu.backend import CPU_OPS, CPUBackend, CPUBufferType
from .cpu.ops import ComputeOptions


class AccelDevice(Device):
    """A ggml_backend_device of type GPU whose memory and kernels are really the CPU's."""
    type = DeviceType.GPU
    op_table: OpTable

    def __init__(self, name: str, supported_ops: Iterable[Op] | None = None,
                 offload_ops: Iterable[Op] = frozenset(), shares_cpu_buft: bool = False,
                 cpu_buft: CPUBufferType | None = None) -> None:
        """supported_ops None means every op the CPU kernels implement. With shares_cpu_buft, pass the
        CPU device's buffer type as cpu_buft so both backends hold the same object (as ggml's BLAS and
        CPU backends share ggml_backend_cpu_buffer_type())."""
        self.name = name
        self.supported_ops = None if supported_ops is None else frozenset(supported_ops)
        # view ops and NONE own no compute: every ggml backend accepts them, whatever their sources
        no_compute = VIEW_OPS | {Op.NONE}
        ops = CPU_OPS.ops if self.supported_ops is None else CPU_OPS.ops & self.supported_ops
        self.op_table = OpTable(ops | no_compute, CPU_OPS.quantized_src | no_compute)
        self.offload_ops = frozenset(offload_ops)
        self.shares_cpu_buft = shares_cpu_buft
        if shares_cpu_buft:
            self.buft = cpu_buft if cpu_buft is not None else CPUBufferType("CPU")
        else:
            # differs from a real GPU: the bytes are numpy host memory, but is_host=False makes the
            # scheduler treat them as device memory (no direct reads by other backends)
            self.buft = CPUBufferType(name, is_host=False)

    def __repr__(self) -> str:
        return f"AccelDevice({self.name})"

    def get_buffer_type(self) -> CPUBufferType:
        return self.buft

    def supports_op(self, t: Tensor) -> bool:
        return self.op_table.supports(t)

    def supports_buft(self, buft: BufferType) -> bool:
        if buft is self.buft:
            return True
        return self.shares_cpu_buft and buft.is_host

    def offload_op(self, t: Tensor) -> bool:
        return t.op in self.offload_ops

    def memory(self) -> tuple[int, int]:
        return 0, 0

    def init_backend(self, async_compute: bool = False,
                     opts: ComputeOptions = ComputeOptions()) -> CPUBackend:
        """The CPU backend machinery (worker thread, events) bound to this device."""
        return CPUBackend(self, async_compute, opts)
