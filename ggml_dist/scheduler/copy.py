"""Copies between backends: blocking, and asynchronous in the source's stream (ggml_backend_tensor_copy,
iface.cpy_tensor_async)."""
from __future__ import annotations

from typing import Any

from ..backends.base import array_at
from ..core.tensor import Tensor


def tensor_copy(src: Tensor, dst: Tensor) -> None:
    """ggml_backend_tensor_copy, blocking. Copies are layout-identical duplicates (same ne and nb)."""
    sb, db = src.buffer, dst.buffer
    assert sb is not None and db is not None and src.data is not None and dst.data is not None, \
        f"copy {src.name} -> {dst.name} between unallocated tensors"
    if sb.base is not None and db.base is not None:
        array_at(db.base, dst.data, dst)[...] = array_at(sb.base, src.data, src)
    else:
        db.set_tensor(dst, sb.get_tensor(src))


def _is_async_capable(backend: Any) -> bool:
    """Stream-ordered: work is submitted in order and events order it across backends."""
    return backend.event_record is not None and backend.event_wait is not None


def cpy_tensor_async(src_backend: Any, dst_backend: Any, src: Tensor, dst: Tensor,
                     dst_free: Any = None) -> bool:
    """ggml's iface.cpy_tensor_async: a backend's own implementation if it has one, else, for two
    stream-ordered backends, the copy runs in the source's stream (as CUDA's peer copy does) and the
    destination waits for it. Returns False where neither applies (the caller copies synchronously).

    differs from ggml: the source stream first waits for `dst_free` (the destination's event of this copy
    slot), because a copy slot is rewritten every n_copies micro-batches and nothing else stops the source
    from overwriting it while the destination still reads it."""
    own = dst_backend.cpy_tensor_async
    if own is not None:
        return bool(own(src_backend, src, dst))
    if not (_is_async_capable(src_backend) and _is_async_capable(dst_backend)):
        return False
    if dst_free is not None:
        src_backend.event_wait(dst_free)
    src_backend.submit(lambda: tensor_copy(src, dst))
    dst_backend.event_wait(src_backend.event_record())
    return True
