"""PyTorch side of the tensorfs client: tensors on segment pages, publish,
and pickling by path for torch.multiprocessing.

Public torch APIs only (torch.frombuffer, Tensor.as_strided, Tensor.set_,
Tensor.view(dtype), torch 1.13 and 2.x alike), with one exception named
where it is used: the reducer torch.multiprocessing registers for tensors,
which ours wraps.

Segments are mapped with Python's mmap, or, for load_state_dict's small
ones, side by side in one range under one storage (map_slab), so tensorfs
knows, by the address of a tensor's storage (and in a range, of its data),
which segment (path) it maps and whether shared or copy-on-write. A
tensor on such a mapping pickles through multiprocessing's ForkingPickler
(torch.multiprocessing queues, DataLoader workers, spawn and fork) as
path + byte offset + layout; the receiving process maps the segment by
path. No descriptor travels, under either sharing strategy, and the
tensor never moves: torch's own reducer would copy a storage it did not
allocate into new shared memory, taking the sender's tensor off the
segment, or (for torch.from_file's storages) fail with EBADF.
"""

from __future__ import annotations

import array as _array
import bisect as _bisect
import ctypes as _ctypes
import errno as _errno
import functools as _functools
import mmap as _mmap
import os as _os
import threading as _threading
import typing as _typing
import warnings as _warnings
import weakref as _weakref

import tensorfs as _tfs

if _typing.TYPE_CHECKING:  # pragma: no cover
    import torch


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("tensorfs: this needs torch (pip install tensorfs[torch], or python3-torch)") from e
    return torch


def torch_dtype(dtype):
    """Return (torch dtype, elements per torch element) for a canonical tensorfs dtype."""
    known = _torch_dtypes.get(dtype)
    if known is not None:
        return known
    torch = _torch()
    e = _tfs.DTYPES[dtype]
    t = getattr(torch, e["torch"], None) if e["torch"] else None
    if not isinstance(t, torch.dtype):
        raise TypeError("tensorfs: torch %s has no %s; open it with tensorfs.open(path, dtype='uint8')"
                        % (torch.__version__, dtype))
    known = _torch_dtypes[dtype] = t, e.get("torch_pack") or 1
    return known


_torch_dtypes = {}  # canonical dtype -> torch_dtype's answer, once found


_sizes = {}


def _element_size(tdt):
    """Bytes per element of a torch dtype (torch.dtype.itemsize is torch >= 2.1 only)."""
    size = _sizes.get(tdt)
    if size is None:
        size = _sizes[tdt] = _torch().empty((), dtype=tdt).element_size()
    return size


def tensorfs_dtype(tdt):
    """Return the canonical tensorfs dtype and pack of a torch dtype."""
    name = str(tdt).split(".")[-1]
    for d, e in _tfs.DTYPES.items():
        if e["torch"] == name:
            return d, e.get("torch_pack") or 1
    raise TypeError("tensorfs: %s has no tensorfs equivalent" % tdt)


def _torch_layout(m, pack):
    """Shape and stride of a segment's tensor in torch elements (packs the last dim)."""
    shape, stride = tuple(m.shape), m.stride
    if pack == 1:
        return shape, (stride if stride is not None else _tfs._contiguous(shape))
    if not shape or shape[-1] % pack:
        raise ValueError("tensorfs: %s %s packs %d elements per torch element along the last dim"
                         % (m.dtype, list(shape), pack))
    shape = shape[:-1] + (shape[-1] // pack,)
    return shape, _tfs._contiguous(shape)


# --- mappings known by address -------------------------------------------

class _Mapping:
    """A segment mapped by this process: its path, whether shared and writable, its size."""

    __slots__ = ("path", "write", "nbytes", "ref", "ident", "published", "warned", "pack")

    def __init__(self, path, write, nbytes, ident, published, pack=None):
        self.path, self.write, self.nbytes = path, write, nbytes
        self.ident = ident  # (st_dev, st_ino, st_size) of path when mapped, or None
        self.published = published  # a publish()ed memfd: readers map the read-only segment
        self.pack = pack  # a pack's (st_ino, st_size): its tensors are at offsets that only it has
        self.ref = None
        self.warned = False  # the copy-on-write divergence warning was given


_lock = _threading.Lock()
_by_address = {}  # storage address -> _Mapping, while its mmap lives
_by_path = {}  # (path, write) -> _Mapping, to reuse a mapping when rebuilding


def _register(mm, path, write, ident, published=False, pack=None):
    """Remember mm as a mapping of path; return a uint8 tensor on all of it."""
    torch = _torch()
    base = torch.frombuffer(mm, dtype=torch.uint8)
    addr = base.data_ptr()
    m = _Mapping(_os.path.abspath(path), write, len(mm), ident, published, pack)

    def forget(_, addr=addr, m=m):
        with _lock:
            if _by_address.get(addr) is m:
                del _by_address[addr]
            if _by_path.get((m.path, m.write)) is m:
                del _by_path[(m.path, m.write)]

    m.ref = _weakref.ref(mm, forget)
    with _lock:
        _by_address[addr] = m
        _by_path[(m.path, write)] = m
    install_reductions()
    return base


def tensor_on(mm, m, path, write, ident=None, published=False):
    """A tensor with TensorMeta m on the mmap mm (None if empty) of the segment at path."""
    torch = _torch()
    tdt, pack = torch_dtype(m.dtype)
    shape, stride = _torch_layout(m, pack)
    if mm is None or _tfs._numel(shape) == 0:
        if _tfs._numel(shape) != 0:
            raise ValueError("tensorfs: %s is empty, shape %r needs data" % (path, list(m.shape)))
        return torch.zeros(shape, dtype=tdt)
    base = _register(mm, path, write, ident, published)
    size = _element_size(tdt)
    if len(mm) % size:
        base = base[:len(mm) // size * size]
    # as_strided checks that the layout fits the storage.
    return base.view(tdt).as_strided(shape, stride, m.storage_offset)


def open_torch(path: str, mode: _typing.Optional[str] = None) -> "torch.Tensor":
    """Map the segment at path as a torch CPU tensor, zero-copy.

    mode "r+" maps it shared and writable: stores reach every process that
    maps the segment. mode "r" maps it copy-on-write (torch has no
    read-only tensors): the tensor shows the segment's bytes until this
    process stores into it, and those stores stay private. The default is
    "r" for FROMFD segments and segments this process may not write, else
    "r+". dtype, shape, stride and storage_offset come from the xattrs.
    The tensor pickles by path through torch.multiprocessing.
    """
    if mode is None:
        mode = "r" if _tfs._read_only(path) else "r+"
    if mode not in ("r+", "r"):
        raise ValueError("tensorfs.open_torch: mode must be 'r+' or 'r', not %r" % (mode,))
    m = _tfs.meta(path)
    torch_dtype(m.dtype)  # before mapping: a dtype torch lacks is a TypeError
    write = mode == "r+"
    mm = _tfs._map(path, write)
    return tensor_on(mm, m, path, write, _ident(path))


def _ident(path):
    st = _os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size)


def tensor_bytes(x):
    """Return (buffer, canonical dtype, shape) of a torch tensor's elements, in order."""
    t = x.detach().to("cpu")
    if t.is_complex():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    dtype, pack = tensorfs_dtype(t.dtype)
    shape = tuple(t.shape)
    if pack != 1:
        shape = shape[:-1] + (shape[-1] * pack,)
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(_torch().uint8).numpy()), dtype, shape


# --- publish --------------------------------------------------------------

def publish(tensor: "torch.Tensor", path: str, *, mount: _typing.Optional[str] = None) -> "torch.Tensor":
    """Move a torch CPU tensor to shared memory that becomes the segment at path.

    The tensor's elements are copied once into a new memfd (as
    share_memory_() copies a tensor into shared memory), the tensor is
    pointed at that memory (Tensor.set_: its other views, if any, keep the
    old storage), and the memfd is imported (the control socket's import):
    from then on the segment and the tensor are the same pages, no copy.
    The segment is read-only (FROMFD) for everyone else and shows later
    in-place changes to tensor; it stays after tensor is freed, until
    unlinked or the daemon exits. Returns the tensor.
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("tensorfs.publish: want a torch.Tensor, got %s" % type(tensor).__name__)
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError("tensorfs.publish: only dense CPU tensors can be published")
    buf, dtype, shape = tensor_bytes(tensor)
    mount, rel = _tfs._resolve(path, mount)
    fd = _os.memfd_create("tensorfs:" + _os.path.basename(rel), _os.MFD_CLOEXEC)
    try:
        nbytes = len(buf)
        if nbytes:
            _os.ftruncate(fd, nbytes)
            mm = _mmap.mmap(fd, nbytes)
            mm[:] = buf
            del buf
            dst = tensor_on(mm, _tfs.TensorMeta(dtype, shape, None, 0, nbytes),
                            _os.path.join(mount, rel), True, published=True)
            with torch.no_grad():
                tensor.set_(dst)
        with _tfs.Client(mount) as c:
            c.import_fd(fd, rel, dtype, shape)
    finally:
        _os.close(fd)
    return tensor


# --- small segments side by side in one range ---------------------------

class _Slab:
    """A range of small segments' mappings, one after another: each one's address and _Mapping."""

    __slots__ = ("starts", "maps", "ref")

    def __init__(self, starts, maps):
        self.starts, self.maps = starts, maps
        self.ref = None

    def find(self, addr):
        """(start address, _Mapping) of the segment whose slot holds addr."""
        i = _bisect.bisect_right(self.starts, addr) - 1
        return self.starts[i], self.maps[i]


_libc = None
_PAGE = _mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, _mmap.PROT_READ | _mmap.PROT_WRITE
_MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x10, 0x20, 0x4000
_MAP_FAILED = _ctypes.c_void_p(-1).value


def _mman():
    """libc with mmap and munmap declared."""
    global _libc
    if _libc is None:
        libc = _ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = _ctypes.c_void_p
        libc.mmap.argtypes = [_ctypes.c_void_p, _ctypes.c_size_t, _ctypes.c_int, _ctypes.c_int, _ctypes.c_int,
                              _ctypes.c_long]
        libc.munmap.argtypes = [_ctypes.c_void_p, _ctypes.c_size_t]
        _libc = libc
    return _libc


def _mmap_at(libc, addr, length, flags, fd, what):
    """mmap(2) of length bytes of fd (or anonymous, fd -1) read-write at addr (or anywhere, None).

    An OSError names what, the thing mapped.
    """
    got = libc.mmap(addr, length, _PROT_NONE if fd < 0 else _PROT_RW, flags, fd, 0)
    if got in (None, _MAP_FAILED):
        e = _ctypes.get_errno()
        raise OSError(e, "tensorfs: mapping %s: %s" % (what, _os.strerror(e)))
    return got


def map_slab(segments, write):
    """Map segments [(fd, nbytes, absolute path)] side by side in one range; return (bases, each one's byte offset).

    A range is reserved, then each segment's pages are mapped into it at
    a page-aligned slot (MAP_FIXED): shared if write, else copy-on-write,
    as mmap's ACCESS_WRITE and ACCESS_COPY. One storage covers the range,
    so a segment's tensor is a view of it (view_on) rather than a mapping
    and a storage of its own; bases holds a tensor of each dtype over the
    whole range (uint8 at first). Each slot pickles by its segment's path.
    The range is unmapped when the last tensor on it is freed.
    """
    torch = _torch()
    offsets, total = [], 0
    for _, nbytes, _ in segments:
        offsets.append(total)
        total += -(-nbytes // _PAGE) * _PAGE
    libc = _mman()
    base = _mmap_at(libc, None, total, _mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1,
                    "a range of %d bytes for %d segments" % (total, len(segments)))
    try:
        flags = (_mmap.MAP_SHARED if write else _mmap.MAP_PRIVATE) | _MAP_FIXED
        for (fd, nbytes, path), off in zip(segments, offsets):
            _mmap_at(libc, base + off, nbytes, flags, fd, path)
        buf = (_ctypes.c_ubyte * total).from_address(base)
    except BaseException:
        libc.munmap(base, total)
        raise
    slab = _Slab([base + off for off in offsets],
                 [_Mapping(path, write, nbytes, None, False) for _, nbytes, path in segments])

    def unmap(_, base=base, total=total, slab=slab):
        with _lock:
            if _by_address.get(base) is slab:
                del _by_address[base]
        libc.munmap(base, total)

    slab.ref = _weakref.ref(buf, unmap)
    for m in slab.maps:
        m.ref = slab.ref
    with _lock:
        _by_address[base] = slab
    install_reductions()
    return {torch.uint8: torch.frombuffer(buf, dtype=torch.uint8)}, offsets


def view_on(bases, offset, nbytes, m, path):
    """A tensor with TensorMeta m on the nbytes at byte offset of map_slab's bases, checked to stay in them."""
    tdt, shape, stride, size, extent = _layout(m.dtype, m.shape, m.stride)
    if m.storage_offset < 0 or (m.storage_offset + extent) * size > nbytes:
        raise ValueError("tensorfs: %s: shape %r, stride %r and offset %d reach past its %d bytes"
                         % (path, list(shape), list(stride), m.storage_offset, nbytes))
    base = bases.get(tdt)
    if base is None:
        base = bases[tdt] = bases[_torch().uint8].view(tdt)
    return base.as_strided(shape, stride, offset // size + m.storage_offset)


def views_on(mm, path, write, items, pack):
    """[tensor] for items [(TensorMeta, byte offset)] on mm, the mmap of the pack at path, whose (st_ino, st_size) is pack.

    Each tensor is a view of one storage over the whole mapping, checked
    to stay in its nbytes (the caller checked that its offset is on a
    whole element: statedict._packed); they pickle by path and offset,
    with pack, which the receiver checks (a save that packs writes a new
    pack, where the offsets hold other tensors), and the mapping lives
    while any of them does. An empty tensor is a tensor of its own.
    """
    torch = _torch()
    base = _register(mm, path, write, None, pack=pack)
    bases, layouts, out = {}, {}, []
    for m, at in items:
        lay = layouts.get(m)
        if lay is None:
            tdt, per = torch_dtype(m.dtype)
            if not _tfs._numel(m.shape):
                lay = layouts[m] = (None, _torch_layout(m, per)[0], tdt)
            else:
                tdt, shape, stride, size, extent = _layout(m.dtype, m.shape, m.stride)
                if (m.storage_offset + extent) * size > m.nbytes:
                    raise ValueError("tensorfs: %s: shape %r, stride %r and offset %d reach past its %d bytes"
                                     % (path, list(shape), list(stride), m.storage_offset, m.nbytes))
                if tdt not in bases:
                    bases[tdt] = base[:len(mm) // size * size].view(tdt)
                lay = layouts[m] = (bases[tdt], shape, stride, size, m.storage_offset)
        if lay[0] is None:
            out.append(torch.zeros(lay[1], dtype=lay[2]))
            continue
        on, shape, stride, size, offset = lay
        out.append(on.as_strided(shape, stride, at // size + offset))
    return out


@_functools.lru_cache(maxsize=256)
def _layout(dtype, shape, stride):
    """(torch dtype, shape, stride, element size, extent in elements) of a non-empty segment's layout."""
    tdt, pack = torch_dtype(dtype)
    shape, stride = _torch_layout(_tfs.TensorMeta(dtype, shape, stride, 0, 0), pack)
    return tdt, shape, stride, _element_size(tdt), _extent(shape, stride)


# --- pickling by path -------------------------------------------------------

def _segment_of(t):
    """(mapping, byte offset) of a tensor that lies on a registered segment mapping, or None."""
    torch = _torch()
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu"
            or t.layout != torch.strided or t.numel() == 0):
        return None
    size = t.element_size()
    start = t.data_ptr() - t.storage_offset() * size
    with _lock:
        m = _by_address.get(start)
    if isinstance(m, _Slab):
        start, m = m.find(t.data_ptr())
    if m is None or m.ref() is None:
        return None
    offset = t.data_ptr() - start
    if offset + _extent(t.shape, t.stride()) * size > m.nbytes:
        return None
    return m, offset


def _extent(shape, stride):
    """Elements from a non-empty strided tensor's first element to its last, both counted."""
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))


_PM_PRESENT, _PM_FILE = 1 << 63, 1 << 61


def _diverged(start, nbytes):
    """Whether any page of [start, start+nbytes) of a private file mapping was written here.

    A written page of a copy-on-write mapping is this process's own
    anonymous page: present in /proc/self/pagemap without the file bit.
    """
    first, last = start // _PAGE, (start + max(nbytes, 1) - 1) // _PAGE
    fd = _os.open("/proc/self/pagemap", _os.O_RDONLY | _os.O_CLOEXEC)
    try:
        step = 1 << 16  # pages per read: 512 KiB of entries
        for p in range(first, last + 1, step):
            n = min(step, last + 1 - p)
            for e in _array.array("Q", _os.pread(fd, n * 8, p * 8)):
                if e & _PM_PRESENT and not e & _PM_FILE:
                    return True
    finally:
        _os.close(fd)
    return False


def _warn_if_diverged(t, m):
    """Warn, once per mapping, that a changed copy-on-write tensor travels as its segment's bytes."""
    if m.write or m.published or m.warned:
        return
    if _diverged(t.data_ptr(), _extent(t.shape, t.stride()) * t.element_size()):
        m.warned = True
        _warnings.warn(
            "tensorfs: a tensor of %s was loaded copy-on-write (mode 'r') and changed in place by this process; "
            "it is sent to the other process by path, which sees the segment's bytes, not these changes. Load "
            "with mode='r+' to change the segment itself, or send tensor.clone()." % m.path,
            RuntimeWarning, stacklevel=3)


def _reduce_tensor(t):
    seg = _segment_of(t)
    if seg is None or (t.requires_grad and not t.is_leaf):
        return _torch_reduce_tensor(t)
    m, offset = seg
    _warn_if_diverged(t, m)
    return (_rebuild_tensor, (m.path, m.write and not m.published, str(t.dtype).split(".")[-1], tuple(t.shape),
                              tuple(t.stride()), offset, t.requires_grad,
                              isinstance(t, _torch().nn.Parameter), m.pack))


def _rebuild_tensor(path, write, dtype, shape, stride, offset, requires_grad, parameter, pack=None):
    """Unpickle a tensor sent by _reduce_tensor: map its segment by path (a pack only if it is the one sent from)."""
    torch = _torch()
    tdt = getattr(torch, dtype)
    ident = _ident(path)
    with _lock:
        m = _by_path.get((path, write))
        mm = m.ref() if m is not None and m.ident == ident and pack is None else None
    if mm is not None:  # this process maps the segment already
        base = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        fd = _tfs._open_fd(path, write)
        try:
            st = _os.fstat(fd)
            if pack is not None and (st.st_ino, st.st_size) != tuple(pack):
                raise OSError(_errno.ESTALE, "tensorfs: a tensor of %s was sent, and that file was replaced since "
                              "(a save that packs writes a new pack, its tensors at other offsets): load it again and "
                              "send a tensor of that load" % path, path)
            mm = _mmap.mmap(fd, st.st_size, access=_mmap.ACCESS_WRITE if write else _mmap.ACCESS_COPY)
        finally:
            _os.close(fd)
        base = _register(mm, path, write, (st.st_dev, st.st_ino, st.st_size))
    size = _element_size(tdt)
    t = base[:len(mm) // size * size].view(tdt).as_strided(shape, stride, offset // size)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


_torch_reduce_tensor = None


def install_reductions():
    """Make tensors on segment mappings pickle by path in multiprocessing.

    Registers a reducer for torch.Tensor and torch.nn.Parameter with
    multiprocessing's ForkingPickler (which torch.multiprocessing queues and
    DataLoader workers use) that handles tensors on a tensorfs mapping and
    hands every other tensor to torch's own reducer. Called on the first
    mapping; idempotent.
    """
    global _torch_reduce_tensor
    if _torch_reduce_tensor is not None:
        return
    # Importing torch.multiprocessing registers torch's reducers (its
    # init_reductions), which ours must come after. Private use:
    # torch.multiprocessing.reductions.reduce_tensor is not in torch's
    # documented API; known to work with torch 1.13 through 2.5.
    import torch.multiprocessing.reductions as reductions
    from multiprocessing.reduction import ForkingPickler
    torch = _torch()
    _torch_reduce_tensor = reductions.reduce_tensor
    for cls in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(cls, _reduce_tensor)
