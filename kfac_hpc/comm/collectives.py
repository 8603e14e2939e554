"""Collectives of the distributed K-FAC: bucketed async factor reduction, broadcasts, flags.

Every collective here works without a process group: when torch.distributed is unavailable or
uninitialised, or the group has one rank, it does nothing (the local tensor already is the
mean, the broadcast source already holds the data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["BROADCAST_BUCKET_MB", "AsyncBroadcaster", "FactorAllreducer", "any_rank", "group_size"]

_MB = 1024 * 1024


def group_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the world for ``None``); 1 without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def _is_square(tensor: torch.Tensor) -> bool:
    """An n×n matrix or a stack (..., n, n) of them (grouped Conv2d factors)."""
    return tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2]


class _Triangle:
    """Pack the upper triangle of n×n matrices (stacks (..., n, n) matrix by matrix) into
    n(n+1)/2 values each, row by row, and rebuild the full symmetric matrices from them.

    Selects with a cached boolean mask of the upper triangle per (n, device): n² bytes, an
    eighth of the int64 flat indices an ``index_select`` would keep resident (2.6 MiB for
    n = 577). ``masked_select`` makes int64 temporaries the size of its whole input (5 MiB
    for one 576-wide float32 matrix, at the peak of a MEM-OPT rank's backward pass), so the
    packing selects about ``PACK_ELEMENTS`` elements at a time: whole matrices of a stack,
    or whole rows of a wide matrix (also faster: 0.8 against 1.9 ms at n = 576, 80 against
    242 ms at 4608). ``masked_scatter_`` makes no such temporaries.
    """

    PACK_ELEMENTS = 1 << 14

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _mask(self, n: int, device: torch.device) -> torch.Tensor:
        """True on and above the diagonal of an n×n matrix."""
        key = (n, device)
        if key not in self._cache:
            self._cache[key] = torch.ones(n, n, dtype=torch.bool, device=device).triu_()
        return self._cache[key]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The upper triangles, row by row, matrix by matrix (a new 1-D tensor)."""
        stack = tensor.detach().reshape(-1, *tensor.shape[-2:])
        n = stack.shape[-1]
        mask = self._mask(n, stack.device)
        values = stack.new_empty(len(stack) * n * (n + 1) // 2)
        offset = 0
        for part, rows in self._parts(stack):
            first, stop = rows.start, rows.stop  # row i holds n - i upper-triangle values
            count = len(part) * (
                (stop - first) * n - (stop * (stop - 1) - first * (first - 1)) // 2
            )
            torch.masked_select(part[:, rows], mask[rows], out=values[offset : offset + count])
            offset += count
        return values

    def _parts(self, stack: torch.Tensor) -> Iterator[tuple[torch.Tensor, slice]]:
        """``stack`` (k, n, n) in parts of about ``PACK_ELEMENTS`` elements, in value order:
        whole matrices at a time, or whole rows of one matrix at a time when n² is more."""
        n = stack.shape[-1]
        if n * n <= self.PACK_ELEMENTS:
            per = self.PACK_ELEMENTS // (n * n)
            for first in range(0, len(stack), per):
                yield stack[first : first + per], slice(0, n)
            return
        rows = max(1, self.PACK_ELEMENTS // n)
        for index in range(len(stack)):
            for first in range(0, n, rows):
                yield stack[index : index + 1], slice(first, min(n, first + rows))

    def unpack(self, values: torch.Tensor, target: torch.Tensor) -> None:
        """Write the symmetric matrices whose upper triangles are ``values`` into ``target``."""
        mask = self._mask(target.shape[-1], target.device).expand(target.shape)
        out = target.detach()
        out.masked_scatter_(mask, values)
        # the transposed view walks the lower triangle in the order the values are in
        out.mT.masked_scatter_(mask, values)


@dataclass(frozen=True)
class _Entry:
    """One submitted tensor and how it is packed (whole, or its upper triangle)."""

    name: str
    tensor: torch.Tensor | None  # written back on arrival; None: not kept (see ``take``)
    symmetric: bool
    count: int  # elements it occupies in the flat buffer
    shape: torch.Size


@dataclass
class _Pending:
    """What every bucket has: its size so far, and once launched its buffer and work."""

    nbytes: int = field(default=0, init=False)
    buffer: torch.Tensor | None = field(default=None, init=False)
    work: dist.Work | None = field(default=None, init=False)


_BucketT = TypeVar("_BucketT", bound=_Pending)
_KeyT = TypeVar("_KeyT")


class _BucketQueue(Generic[_KeyT, _BucketT]):
    """Open buckets by key, each launched as one collective once it holds ``bucket_cap_mb``
    MiB or at :meth:`flush`; subclasses say how a bucket is launched."""

    def __init__(self, bucket_cap_mb: float, option: str) -> None:
        if not bucket_cap_mb >= 0:
            raise ValueError(f"{option}={bucket_cap_mb!r} must be >= 0 (MiB; 0 = no bucketing)")
        self.bucket_cap_bytes = int(bucket_cap_mb * _MB)
        self._open: dict[_KeyT, _BucketT] = {}
        self._launched: list[_BucketT] = []

    def _cap(self, key: _KeyT) -> int:
        """The byte size at which the bucket of ``key`` is launched."""
        return self.bucket_cap_bytes

    def _enqueue(self, key: _KeyT, nbytes: int, new: Callable[[], _BucketT]) -> _BucketT:
        """The open bucket of ``key`` with room for ``nbytes`` more (launching a full one first);
        the caller adds its tensor to it and then calls :meth:`_added`."""
        bucket = self._open.get(key)
        if bucket is not None and bucket.nbytes + nbytes > self._cap(key):
            self._launch(self._open.pop(key))
            bucket = None
        if bucket is None:
            bucket = self._open[key] = new()
        bucket.nbytes += nbytes
        return bucket

    def _added(self, key: _KeyT) -> None:
        if self._open[key].nbytes >= self._cap(key):
            self._launch(self._open.pop(key))

    def flush(self) -> None:
        """Launch every partly filled bucket."""
        for bucket in self._open.values():
            self._launch(bucket)
        self._open.clear()

    def _launch(self, bucket: _BucketT) -> None:
        raise NotImplementedError


@dataclass
class _Bucket(_Pending):
    """Tensors of one (dtype, device, dst) packed into one flat buffer for one collective."""

    dst: int | None
    entries: list[_Entry] = field(default_factory=list)
    flats: list[torch.Tensor] = field(default_factory=list)  # 1-D pieces until launched
    copied: bool = False  # whether a single piece is already its own copy (not a view)


_FactorKey = tuple[torch.dtype, torch.device, int | None]


class FactorAllreducer(_BucketQueue[_FactorKey, _Bucket]):
    """Average tensors over a process group in flat buckets of ``bucket_cap_mb``, asynchronously.

    ``submit`` queues a tensor in the open bucket of its (dtype, device, destination); a bucket
    is copied into one flat buffer and launched (``async_op=True``) as soon as it holds
    ``bucket_cap_mb`` MiB, so submitting from backward hooks overlaps communication with the
    rest of the backward pass. A tensor that does not fit in the open bucket launches that
    bucket first; a tensor larger than the cap travels alone. ``bucket_cap_mb=0`` sends every
    tensor on its own. ``wait()`` writes the means back in place. With ``symmetric`` only the
    upper triangle of square matrices travels (about half the bytes) and the full matrix is
    rebuilt on arrival; the caller guarantees symmetry. Stacks of matrices (..., n, n) are
    packed matrix by matrix.

    Reductions to one rank (``dst``) are bucketed per destination with ``reduce_bucket_cap_mb``
    (default: ``bucket_cap_mb``), which also bounds the open (not yet launched) buckets of all
    destinations together: a tensor that would pass it launches the oldest open ones first.
    They hold no reference to a submitted tensor on the other ranks once its bucket is
    launched; a finished one is released (its buffer freed, or on ``dst`` written back) at the
    next ``submit``, so the caller may drop such a tensor right after submitting it and the
    transient memory stays a few buckets; ``reduce_in_flight_mb`` bounds the bytes of those in
    flight (a launch first waits for the oldest ones). With ``write_back=False`` no rank keeps
    the tensor: the mean stays packed in the arrived buffer (half the bytes for a triangle)
    until :meth:`take` rebuilds it.
    """

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        group: ProcessGroup | None = None,
        symmetric: bool = False,
        reduce_bucket_cap_mb: float | None = None,
        reduce_in_flight_mb: float | None = None,
    ) -> None:
        super().__init__(bucket_cap_mb, "allreduce_bucket_cap_mb")
        cap = bucket_cap_mb if reduce_bucket_cap_mb is None else reduce_bucket_cap_mb
        if not cap >= 0:
            raise ValueError(f"reduce_bucket_cap_mb={cap!r} must be >= 0 (MiB)")
        if reduce_in_flight_mb is not None and not reduce_in_flight_mb >= 0:
            raise ValueError(f"reduce_in_flight_mb={reduce_in_flight_mb!r} must be >= 0 (MiB)")
        self.reduce_cap_bytes = int(cap * _MB)
        self.reduce_in_flight_bytes = (
            None if reduce_in_flight_mb is None else int(reduce_in_flight_mb * _MB)
        )
        self.group = group
        self.symmetric = symmetric
        self._triangle = _Triangle()
        self._names: set[str] = set()
        self._written: list[str] = []
        self._arrived: dict[str, tuple[torch.Tensor, _Entry]] = {}

    def _cap(self, key: _FactorKey) -> int:
        return self.bucket_cap_bytes if key[2] is None else self.reduce_cap_bytes

    def _enqueue(self, key: _FactorKey, nbytes: int, new: Callable[[], _Bucket]) -> _Bucket:
        if key[2] is not None:
            self._bound_open_reductions(key, nbytes)
        return super()._enqueue(key, nbytes, new)

    def _bound_open_reductions(self, key: _FactorKey, nbytes: int) -> None:
        """Launch the oldest open reduction buckets (to other destinations) until those left
        plus ``key``'s, with ``nbytes`` more, fit in the reduce cap. Depends only on the order
        and sizes of the submissions: the same on every rank."""
        own = self._open.get(key)
        total = nbytes + (own.nbytes if own and own.nbytes + nbytes <= self.reduce_cap_bytes else 0)
        others = [k for k in self._open if k[2] is not None and k != key]
        total += sum(self._open[k].nbytes for k in others)
        for other in others:
            if total <= self.reduce_cap_bytes:
                break
            bucket = self._open.pop(other)
            total -= bucket.nbytes
            self._launch(bucket)

    @property
    def pending(self) -> bool:
        """Whether tensors were submitted since the last ``wait()``."""
        return bool(self._names)

    @property
    def buckets_in_flight(self) -> int:
        """Buckets whose collective was launched and not yet waited for."""
        return len(self._launched)

    @property
    def arrived(self) -> list[str]:
        """Names submitted with ``write_back=False`` whose mean arrived here, not yet taken."""
        return list(self._arrived)

    def submit(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        symmetric: bool | None = None,
        dst: int | None = None,
        write_back: bool = True,
    ) -> None:
        """Queue ``tensor`` for averaging; ``dst`` (a global rank) reduces to that rank only.

        Do not write to ``tensor`` before ``wait()``. ``write_back=False``: the reducer keeps
        no reference to ``tensor`` (the caller may free it now); after ``wait()`` the ranks
        that receive the mean get it from :meth:`take`.
        """
        if name in self._names:
            raise ValueError(f"tensor {name!r} was submitted twice before wait()")
        pack_triangle = self.symmetric if symmetric is None else symmetric
        if pack_triangle and not _is_square(tensor):
            raise ValueError(
                f"tensor {name!r} of shape {tuple(tensor.shape)} is not square (..., n, n)"
            )
        self._names.add(name)
        if group_size(self.group) == 1:
            if not write_back:  # the local tensor already is the mean
                flat = tensor.detach().reshape(-1)
                self._arrived[name] = (flat, _Entry(name, None, False, flat.numel(), tensor.shape))
            return
        if pack_triangle:
            packed = self._triangle.pack(tensor)
        else:  # a view of the caller's tensor, unless it is not to be kept
            packed = tensor.detach().reshape(-1)
            packed = packed if write_back else packed.clone()
        key = (tensor.dtype, tensor.device, dst)
        nbytes = packed.numel() * packed.element_size()
        bucket = self._enqueue(key, nbytes, lambda: _Bucket(dst))
        kept = tensor if write_back and (dst is None or dst == dist.get_rank()) else None
        bucket.entries.append(_Entry(name, kept, pack_triangle, packed.numel(), tensor.shape))
        bucket.flats.append(packed)
        bucket.copied = (pack_triangle or not write_back) and len(bucket.flats) == 1
        self._added(key)
        self._release_finished()

    def wait(self) -> list[str]:
        """Flush, wait for every bucket and write the means back (or keep them for ``take``);
        returns the names whose mean arrived on this rank."""
        self.flush()
        for bucket in self._launched:
            self._finish(bucket)
        written = self._written
        self._launched.clear()
        self._names.clear()
        self._written = []
        return written

    def take(self, name: str) -> torch.Tensor:
        """The mean of ``name`` submitted with ``write_back=False``, as a new tensor of its
        shape (on the ranks that receive it, after ``wait()``); ``KeyError`` otherwise."""
        try:
            values, entry = self._arrived.pop(name)
        except KeyError:
            raise KeyError(f"no arrived mean of {name!r} to take on this rank") from None
        out = values.new_empty(entry.shape)
        self._write(values, entry, out)
        return out

    def _release_finished(self) -> None:
        """Finish the reductions to one rank whose collective is done (frees their buffers)."""
        done = [b for b in self._launched if b.dst is not None and b.work and b.work.is_completed()]
        for bucket in done:
            self._finish(bucket)
            self._launched.remove(bucket)

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``; where it has a result, divide and write it back."""
        assert bucket.work is not None and bucket.buffer is not None
        bucket.work.wait()
        if bucket.dst is None or bucket.dst == dist.get_rank():
            bucket.buffer.div_(group_size(self.group))
            self._written.extend(self._unpack(bucket))
        bucket.buffer = None

    def _bound_in_flight(self, nbytes: int) -> None:
        """Wait for the oldest reductions to one rank until those still in flight plus
        ``nbytes`` fit in ``reduce_in_flight_mb``. Deadlock-free: every rank launches the
        same collectives in the same order, so the oldest one waited for anywhere has been
        launched by every rank that waits, and the others are still going to launch it."""
        assert self.reduce_in_flight_bytes is not None
        self._release_finished()
        flying = [b for b in self._launched if b.dst is not None]
        total = nbytes + sum(b.nbytes for b in flying)
        for bucket in flying:
            if total <= self.reduce_in_flight_bytes:
                break
            self._finish(bucket)
            self._launched.remove(bucket)
            total -= bucket.nbytes

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.dst is not None and self.reduce_in_flight_bytes is not None:
            self._bound_in_flight(bucket.nbytes)
        flats = bucket.flats
        if len(flats) == 1:  # a packed triangle is already this bucket's own copy
            bucket.buffer = flats[0] if bucket.copied else flats[0].clone()
        else:
            bucket.buffer = torch.cat(flats)
        bucket.flats = []  # the buffer holds the only copy that travels
        if bucket.dst is None:
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        else:
            bucket.work = dist.reduce(
                bucket.buffer, dst=bucket.dst, group=self.group, async_op=True
            )
        self._launched.append(bucket)

    def _unpack(self, bucket: _Bucket) -> list[str]:
        assert bucket.buffer is not None
        offset = 0
        for entry in bucket.entries:
            values = bucket.buffer[offset : offset + entry.count]
            if entry.tensor is None:
                self._arrived[entry.name] = (values, entry)  # keeps the buffer until taken
            else:
                self._write(values, entry, entry.tensor)
            offset += entry.count
        return [entry.name for entry in bucket.entries]

    def _write(self, values: torch.Tensor, entry: _Entry, target: torch.Tensor) -> None:
        """Write the flat (or packed upper-triangle) ``values`` of ``entry`` into ``target``."""
        with torch.no_grad():
            if entry.symmetric:
                self._triangle.unpack(values, target)
            else:
                target.copy_(values.view_as(target))


@dataclass
class _Broadcast(_Pending):
    """Tensors sent from one ``src`` in one group, as one flat broadcast."""

    src: int
    group: ProcessGroup | None
    tensors: list[torch.Tensor] = field(default_factory=list)


_BroadcastKey = tuple[int, int, torch.dtype, torch.device]


# the bucket of AsyncBroadcaster by default: what the preconditioner sends (plan prices it)
BROADCAST_BUCKET_MB = 25.0


class AsyncBroadcaster(_BucketQueue[_BroadcastKey, _Broadcast]):
    """Broadcast tensors asynchronously in flat buckets, then wait for all of them at once.

    ``broadcast`` queues a tensor in the open bucket of its (src, group, dtype, device); a bucket
    is sent as one ``broadcast(async_op=True)`` when it holds ``bucket_cap_mb`` MiB or at
    ``flush()``/``wait()``, which saves the per-collective latency of many small tensors (one
    preconditioned gradient or eigendecomposition per layer). ``bucket_cap_mb=0`` sends every
    tensor at once on its own. Receivers pass a preallocated tensor of the sender's shape, dtype
    and device; ``wait()`` overwrites it in place. ``src`` is a global rank (torch's convention,
    also within a group). The ranks of a group must queue its tensors in the same order.
    """

    def __init__(
        self, group: ProcessGroup | None = None, bucket_cap_mb: float = BROADCAST_BUCKET_MB
    ) -> None:
        super().__init__(bucket_cap_mb, "bucket_cap_mb")
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
        """Queue ``tensor`` to go from ``src`` to every rank of ``group`` (default: the
        constructor's). Do not touch it before ``wait()``."""
        chosen = self.group if group is None else group
        if group_size(chosen) == 1:
            return
        key = (src, id(chosen), tensor.dtype, tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        self._enqueue(key, nbytes, lambda: _Broadcast(src, chosen)).tensors.append(tensor)
        self._added(key)

    def wait(self) -> None:
        """Flush, wait for every broadcast and write what arrived into the receivers' tensors."""
        self.flush()
        for bucket in self._launched:
            assert bucket.work is not None and bucket.buffer is not None
            bucket.work.wait()
            if bucket.buffer is bucket.tensors[0] or bucket.src == dist.get_rank():
                continue  # sent in place, or this rank is the sender
            offset = 0
            with torch.no_grad():
                for tensor in bucket.tensors:
                    count = tensor.numel()
                    tensor.copy_(bucket.buffer[offset : offset + count].view_as(tensor))
                    offset += count
        self._launched.clear()

    def _launch(self, bucket: _Broadcast) -> None:
        tensors = bucket.tensors
        if len(tensors) == 1 and tensors[0].is_contiguous():
            bucket.buffer = tensors[0]  # no packing: broadcast in place
        elif bucket.src == dist.get_rank():
            bucket.buffer = torch.cat([t.detach().reshape(-1) for t in tensors])
        else:
            total = sum(t.numel() for t in tensors)
            bucket.buffer = tensors[0].new_empty(total)
        bucket.work = dist.broadcast(
            bucket.buffer, src=bucket.src, group=bucket.group, async_op=True
        )
        self._launched.append(bucket)


def any_rank(
    flag: bool, group: ProcessGroup | None = None, device: torch.device | None = None
) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on any of them (one all_reduce).

    ``device`` must be a CUDA device under NCCL.
    """
    if group_size(group) == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
