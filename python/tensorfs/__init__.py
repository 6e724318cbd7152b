"""tensorfs client: tensors in a tensorfs mount, zero-copy, from Python.

Every file of a tensorfs mount is one shared-memory segment; its dtype and
shape are the extended attributes ``user.tensor.dtype`` and
``user.tensor.shape`` (and optionally ``user.tensor.stride`` and
``user.tensor.storage_offset``, in elements). Pure Python, standard library
only; NumPy and PyTorch are imported when a function needs them.

Example::

    import numpy as np, torch, tensorfs
    tensorfs.save("/mnt/t/w", np.arange(12, dtype=np.float32).reshape(3, 4))
    a = tensorfs.open("/mnt/t/w")          # np.memmap on the segment's pages
    a[0, 0] = 42                           # every process mapping /mnt/t/w sees it
    t = tensorfs.open_torch("/mnt/t/w")    # torch view of the same pages
    x = torch.randn(1024, 768)
    tensorfs.publish(x, "/mnt/t/x")        # x's shared memory becomes /mnt/t/x (read-only)
    x.mul_(2)                              # ...and readers of /mnt/t/x see the change
    fd = tensorfs.export_fd("/mnt/t/k")    # a KEEPFD segment's descriptor; os.close(fd)

Control-socket operations (publish, import_fd, export_fd, all_gather_fds,
broadcast_fd) raise ``OSError(errno, message)`` with the daemon's errno and
reason when the daemon refuses a request.
"""

import array as _array
import collections as _collections
import errno as _errno
import json as _json
import os as _os
import socket as _socket

__all__ = [
    "Client",
    "TensorMeta",
    "all_gather_fds",
    "broadcast_fd",
    "export_fd",
    "find_mount",
    "import_fd",
    "meta",
    "open",
    "open_torch",
    "publish",
    "save",
    "socket_path",
]


XATTR_DTYPE = "user.tensor.dtype"
XATTR_SHAPE = "user.tensor.shape"
XATTR_STRIDE = "user.tensor.stride"
XATTR_OFFSET = "user.tensor.storage_offset"
XATTR_FLAGS = "user.tensorfs.flags"
XATTR_SOCKET = "user.tensorfs.socket"

# canonical dtype -> (element size, NumPy name or None, torch attribute or None)
_DTYPES = {
    "float32": (4, "float32", "float32"),
    "float64": (8, "float64", "float64"),
    "float16": (2, "float16", "float16"),
    "bfloat16": (2, None, "bfloat16"),
    "complex64": (8, "complex64", "complex64"),
    "complex128": (16, "complex128", "complex128"),
    "int8": (1, "int8", "int8"),
    "uint8": (1, "uint8", "uint8"),
    "int16": (2, "int16", "int16"),
    "int32": (4, "int32", "int32"),
    "int64": (8, "int64", "int64"),
    "bool": (1, "bool", "bool"),
    "uint16": (2, "uint16", "uint16"),
    "uint32": (4, "uint32", "uint32"),
    "uint64": (8, "uint64", "uint64"),
    "float8_e4m3fn": (1, None, "float8_e4m3fn"),
    "float8_e5m2": (1, None, "float8_e5m2"),
}

_ALIASES = {
    "float": "float32", "single": "float32", "double": "float64", "half": "float16",
    "cfloat": "complex64", "csingle": "complex64", "cdouble": "complex128",
    "short": "int16", "int": "int32", "long": "int64", "bool_": "bool",
    "f2": "float16", "f4": "float32", "f8": "float64", "c8": "complex64", "c16": "complex128",
    "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64",
    "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "b1": "bool", "?": "bool",
}

TensorMeta = _collections.namedtuple("TensorMeta", "dtype shape stride storage_offset nbytes")
TensorMeta.__doc__ = """A segment's tensor metadata: canonical dtype name, shape, stride and
storage_offset (elements; stride None means contiguous) and the segment's size in bytes."""


def _canonical(name):
    """Return the canonical tensorfs spelling of a dtype name, or raise TypeError."""
    s = str(name).strip().lower()
    if s.startswith("torch."):
        s = s[len("torch."):]
    if s[:1] in "<=|" and s[1:] in _ALIASES:
        s = s[1:]
    s = _ALIASES.get(s, s)
    if s not in _DTYPES:
        raise TypeError("tensorfs: unknown dtype %r" % (name,))
    return s


def _getxattr(path, name):
    try:
        return _os.getxattr(path, name).decode()
    except OSError as e:
        if e.errno in (_errno.ENODATA, _errno.ENOTSUP):
            return None
        raise


def _parse_dims(s):
    s = s.strip()
    if s[:1] in "[(":
        s = s[1:-1]
    return tuple(int(p) for p in s.split(",") if p.strip())


def _format_dims(dims):
    return "[" + ", ".join(str(int(d)) for d in dims) + "]"


def meta(path):
    """Read a segment's TensorMeta from its xattrs.

    A missing dtype reads as uint8 and a missing shape as one dimension
    spanning the whole segment.
    """
    nbytes = _os.stat(path).st_size
    dtype = _canonical(_getxattr(path, XATTR_DTYPE) or "uint8")
    shape = _getxattr(path, XATTR_SHAPE)
    shape = _parse_dims(shape) if shape is not None else (nbytes // _DTYPES[dtype][0],)
    stride = _getxattr(path, XATTR_STRIDE)
    stride = _parse_dims(stride) if stride is not None else None
    offset = int(_getxattr(path, XATTR_OFFSET) or 0)
    return TensorMeta(dtype, shape, stride, offset, nbytes)


def _contiguous(shape):
    stride, n = [], 1
    for d in reversed(shape):
        stride.append(n)
        n *= max(int(d), 1)
    return tuple(reversed(stride))


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _np():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tensorfs: this needs numpy") from e
    return numpy


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tensorfs: this needs torch") from e
    return torch


def _numpy_dtype(dtype):
    np = _np()
    name = _DTYPES[dtype][1]
    if name is None:
        raise TypeError(
            "tensorfs: numpy has no %s; open the segment with tensorfs.open_torch() instead" % dtype)
    return np.dtype(name).newbyteorder("<")


def _torch_dtype(dtype):
    torch = _torch()
    t = getattr(torch, _DTYPES[dtype][2], None)
    if not isinstance(t, torch.dtype):
        raise TypeError("tensorfs: torch %s has no %s" % (torch.__version__, dtype))
    return t


def open(path, mode="r+", *, dtype=None, shape=None):
    """Map the segment at path as a NumPy array, zero-copy (np.memmap).

    dtype, shape, stride and storage_offset come from the segment's xattrs;
    dtype or shape arguments override them (the array then starts at byte 0
    and is contiguous; a missing shape spans the segment). mode is "r+"
    (read-write, shared with every other process), "r" (read-only; needed
    for FROMFD segments, which refuse write opens with EPERM) or "c"
    (copy-on-write). bfloat16 and float8 segments raise TypeError: use
    open_torch().
    """
    if mode not in ("r+", "r", "c"):
        raise ValueError("tensorfs.open: mode must be 'r+', 'r' or 'c', not %r" % (mode,))
    np = _np()
    m = meta(path)
    if dtype is not None or shape is not None:
        dt = _canonical(dtype) if dtype is not None else m.dtype
        if shape is None:
            shape = (m.nbytes // _DTYPES[dt][0],)
        m = TensorMeta(dt, tuple(int(d) for d in shape), None, 0, m.nbytes)
    ndt = _numpy_dtype(m.dtype)
    size = _DTYPES[m.dtype][0]
    shape, offset = m.shape, m.storage_offset
    stride = m.stride if m.stride is not None else _contiguous(shape)
    if m.nbytes == 0 or _numel(shape) == 0:
        if _numel(shape) != 0:
            raise ValueError("tensorfs.open: %s is empty, shape %r needs data" % (path, shape))
        return np.zeros(shape, dtype=ndt)  # nothing to map: mmap refuses empty files
    if stride == _contiguous(shape):
        return np.memmap(path, dtype=ndt, mode=mode, offset=offset * size, shape=shape)
    base = np.memmap(path, dtype=np.uint8, mode=mode)
    # np.ndarray checks that the strided extent fits in the buffer.
    return np.ndarray(shape, dtype=ndt, buffer=base, offset=offset * size,
                      strides=tuple(s * size for s in stride))


def _is_read_only(path):
    flags = _getxattr(path, XATTR_FLAGS) or ""
    return "FROMFD" in flags.split("|") or not _os.access(path, _os.W_OK)


def open_torch(path, mode=None):
    """Map the segment at path as a torch CPU tensor, zero-copy.

    mode "r+" uses torch.from_file(path, shared=True) on the whole segment,
    then as_strided to the xattrs' shape, stride and storage_offset: a
    shared, writable mapping. mode "r" maps the segment copy-on-write
    (torch has no read-only tensors; torch.from_file(shared=False) would
    copy the file): pages stay the segment's own, showing its current
    bytes, until this process stores into them. The default is "r" for
    FROMFD or unwritable segments, else "r+".
    """
    torch = _torch()
    if mode is None:
        mode = "r" if _is_read_only(path) else "r+"
    if mode not in ("r+", "r"):
        raise ValueError("tensorfs.open_torch: mode must be 'r+' or 'r', not %r" % (mode,))
    m = meta(path)
    tdt = _torch_dtype(m.dtype)
    size = _DTYPES[m.dtype][0]
    stride = m.stride if m.stride is not None else _contiguous(m.shape)
    numel = m.nbytes // size
    if numel == 0:
        if _numel(m.shape) != 0:
            raise ValueError("tensorfs.open_torch: %s is empty, shape %r needs data" % (path, m.shape))
        return torch.zeros(m.shape, dtype=tdt)
    if mode == "r":
        np = _np()
        raw = np.memmap(path, dtype=np.uint8, mode="c", shape=(numel * size,))
        base = torch.from_numpy(raw).view(tdt)
        return base.as_strided(m.shape, stride, m.storage_offset)
    # Fail early with the mount's errno (from_file's message has none).
    _os.close(_os.open(path, _os.O_RDWR | _os.O_CLOEXEC))
    base = torch.from_file(path, shared=True, size=numel, dtype=tdt)
    return base.as_strided(m.shape, stride, m.storage_offset)


def _as_bytes_source(x):
    """Return (buffer, canonical dtype, shape, keepalive) for a numpy array or torch tensor."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        torch = _torch()
        t = x.detach().to("cpu")
        if t.is_complex():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        t = t.contiguous()
        dtype = _canonical(str(t.dtype))
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return b"", dtype, tuple(t.shape), t
        import ctypes
        buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
        return memoryview(buf).cast("B"), dtype, tuple(t.shape), t
    np = _np()
    a = np.asarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    try:
        dtype = _canonical(a.dtype.name)
    except TypeError:
        raise TypeError("tensorfs.save: dtype %s has no tensorfs equivalent" % a.dtype) from None
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # np.ascontiguousarray would make a 0-d array 1-d
    return memoryview(a.reshape(-1).view(np.uint8)), dtype, tuple(a.shape), a


def save(path, x):
    """Write a NumPy array or torch tensor (a contiguous copy) to path.

    The file is created or truncated, its old tensor xattrs removed, the
    bytes written, then user.tensor.dtype and user.tensor.shape set.
    """
    buf, dtype, shape, keep = _as_bytes_source(x)
    fd = _os.open(path, _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC | _os.O_CLOEXEC, 0o644)
    try:
        for name in (XATTR_SHAPE, XATTR_STRIDE, XATTR_OFFSET, XATTR_DTYPE):
            try:
                _os.removexattr(fd, name)
            except OSError as e:
                if e.errno not in (_errno.ENODATA, _errno.ENOTSUP):
                    raise
        view = memoryview(buf)
        while view:
            n = _os.write(fd, view)
            view = view[n:]
        del view, buf
        _os.setxattr(fd, XATTR_DTYPE, dtype.encode())
        _os.setxattr(fd, XATTR_SHAPE, _format_dims(shape).encode())
    finally:
        _os.close(fd)
        del keep


# --- control socket -------------------------------------------------------

_MAX_FDS = 253
_MAX_MSG = 65536


def find_mount(path):
    """Return the root of the tensorfs mount holding path (it need not exist yet)."""
    d = _os.path.dirname(_os.path.abspath(path))
    if _os.path.isdir(path):
        d = _os.path.abspath(path)
    while True:
        try:
            if _getxattr(d, XATTR_SOCKET):
                return d
        except OSError:
            pass
        parent = _os.path.dirname(d)
        if parent == d:
            raise OSError(_errno.ENOENT, "tensorfs: %s is not inside a tensorfs mount" % path, path)
        d = parent


def socket_path(mount):
    """Return the control socket path of the mount rooted at mount."""
    s = _getxattr(mount, XATTR_SOCKET)
    if not s:
        raise OSError(_errno.ENOENT, "tensorfs: %s is not a tensorfs mount root" % mount, mount)
    return s


def _resolve(path, mount):
    """Return (mount root, path relative to it)."""
    if mount is None:
        mount = find_mount(path)
        rel = _os.path.relpath(_os.path.abspath(path), mount)
    elif _os.path.isabs(path):
        rel = _os.path.relpath(path, mount)
    else:
        rel = path
    if rel == "." or rel == ".." or rel.startswith("../"):
        raise ValueError("tensorfs: %s is not a segment inside %s" % (path, mount))
    return mount, rel


class Client:
    """One connection to a mount's control socket (requests go one at a time).

    Use as a context manager or call close(). Descriptors returned by its
    methods are new, close-on-exec, and belong to the caller.
    """

    def __init__(self, mount, timeout=None):
        self.mount = mount
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(socket_path(mount))
        except BaseException:
            self.sock.close()
            raise

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, req, fds=(), want=0, filename=None):
        """Send one request (a dict, "v" added) with fds attached; return the reply's fds."""
        msg = _json.dumps(dict(req, v=1)).encode()
        if fds:
            _socket.send_fds(self.sock, [msg], list(fds))
        else:
            self.sock.sendmsg([msg])
        # Not socket.recv_fds: it ignores its flags (MSG_CMSG_CLOEXEC) before Python 3.12.
        data, anc, flags, _ = self.sock.recvmsg(_MAX_MSG, _socket.CMSG_SPACE(_MAX_FDS * 4),
                                                _socket.MSG_CMSG_CLOEXEC)
        got = []
        for level, typ, blob in anc:
            if level == _socket.SOL_SOCKET and typ == _socket.SCM_RIGHTS:
                got.extend(_array.array("i", blob[:len(blob) - len(blob) % 4]))
        try:
            if not data:
                raise ConnectionError("tensorfs: the daemon closed the control connection")
            if flags & (_socket.MSG_CTRUNC | _socket.MSG_TRUNC):
                raise OSError(_errno.EMSGSIZE, "tensorfs: reply truncated (out of descriptors?)")
            rep = _json.loads(data)
            if not rep.get("ok"):
                e = int(rep.get("errno") or _errno.EIO)
                msg = "tensorfs %s: %s" % (req.get("op"), rep.get("error") or _os.strerror(e))
                if filename is not None:
                    raise OSError(e, msg, filename)
                raise OSError(e, msg)
            if len(got) != want or rep.get("fds", 0) != want:
                raise OSError(_errno.EPROTO, "tensorfs %s: reply has %d descriptors, want %d"
                              % (req.get("op"), len(got), want))
        except BaseException:
            for fd in got:
                _os.close(fd)
            raise
        return got

    def export(self, path, write=False):
        """Return a new fd of the KEEPFD segment at path (relative to the mount root)."""
        return self.request({"op": "export", "path": path, "write": bool(write)}, want=1,
                            filename=path)[0]

    def import_fd(self, fd, path, dtype=None, shape=None):
        """Make fd (regular file or memfd) the read-only FROMFD segment at path, no copy."""
        req = {"op": "import", "path": path}
        if dtype is not None:
            req["dtype"] = _canonical(dtype)
        if shape is not None:
            req["shape"] = shape if isinstance(shape, str) else _format_dims(shape)
        self.request(req, [fd], filename=path)

    def all_gather(self, group, rank, world, fd, open_group=False):
        """Send fd as rank of group; return the world fds of all ranks, in rank order.

        Groups are the caller's uid's own; open_group=True (on every rank)
        joins the group of that name open to every uid instead.
        """
        req = {"op": "all_gather", "group": group, "rank": int(rank), "world": int(world)}
        if open_group:
            req["open"] = True
        return self.request(req, [fd], want=int(world))

    def broadcast(self, group, rank, world, root, fd=None, open_group=False):
        """Join a broadcast from root: root sends fd and gets None; others get root's fd.

        open_group as for all_gather.
        """
        req = {"op": "broadcast", "group": group, "rank": int(rank), "world": int(world),
               "root": int(root)}
        if open_group:
            req["open"] = True
        if rank == root:
            if fd is None:
                raise ValueError("tensorfs.broadcast_fd: the root must pass fd")
            self.request(req, [fd])
            return None
        return self.request(req, want=1)[0]


def export_fd(path, write=False, *, mount=None):
    """Return a descriptor of the KEEPFD segment at path (O_RDWR if write).

    The fd is new and close-on-exec; the caller owns it and must os.close()
    it (mmap it first if you like: a mapping outlives the fd). Refused with
    EPERM unless the segment's flags contain KEEPFD, EACCES without the
    permission open() would need.
    """
    mount, rel = _resolve(path, mount)
    with Client(mount) as c:
        return c.export(rel, write)


def import_fd(fd, path, dtype=None, shape=None, *, mount=None):
    """Make fd (a regular file or memfd) the segment at path without a copy.

    The segment is read-only (FROMFD) and lives as long as the daemon that
    holds its own duplicate of fd; fd stays the caller's. dtype and shape
    (a sequence or "[a, b]") become its xattrs. EEXIST if path exists.
    """
    mount, rel = _resolve(path, mount)
    with Client(mount) as c:
        c.import_fd(fd, rel, dtype, shape)


def _untyped_storage(t):
    if hasattr(t, "untyped_storage"):  # torch >= 2.0
        return t.untyped_storage()
    s = t.storage()
    for name in ("untyped", "_untyped"):
        if hasattr(s, name):
            return getattr(s, name)()
    return s._storage


def _storage_fd(storage, nbytes):
    """Return (fd, owned, header) for a shared CPU storage.

    owned fds are ours to close; header is how many bytes precede the
    storage's data in the file.
    """
    try:
        fd = storage._get_shared_fd()  # file_descriptor strategy: MapAllocator's kept fd
    except RuntimeError:
        fd = None
    if fd is not None:
        if fd < 0:
            raise ValueError("tensorfs.publish: the tensor maps a file (torch.from_file) "
                             "without a kept descriptor; it cannot be published")
        return fd, False, 0
    # file_system strategy: the storage is a named /dev/shm file kept by
    # torch_shm_manager (for a storage already shared this way the call only
    # reports its name). RefcountedMapAllocator puts a 64-byte refcount
    # header before the data.
    _, name, _ = storage._share_filename_cpu_()
    name = name.decode() if isinstance(name, bytes) else name
    fd = _os.open("/dev/shm/" + name.lstrip("/"), _os.O_RDONLY | _os.O_CLOEXEC)
    header = _os.fstat(fd).st_size - nbytes
    if header != _REFCOUNT_HEADER:
        _os.close(fd)
        raise ValueError("tensorfs.publish: /dev/shm%s has %d bytes around a %d-byte storage, "
                         "not the %d-byte header expected" % (name, header, nbytes, _REFCOUNT_HEADER))
    return fd, True, header


# TH_ALLOC_ALIGNMENT: the refcount header of torch's file_system-strategy files.
_REFCOUNT_HEADER = 64


def publish(tensor, path, *, mount=None):
    """Make a torch CPU tensor's shared-memory storage the segment at path, no copy.

    Moves the tensor to shared memory first if needed (tensor.share_memory_(),
    following torch.multiprocessing's sharing strategy), then sends its
    storage's descriptor to the daemon (import). The segment is read-only
    (FROMFD) for everyone else and shows later in-place changes to tensor;
    it stays after tensor is freed, until unlinked or the daemon exits.
    xattrs: dtype and shape, plus stride and storage_offset for views that
    are not the whole storage in order, and under the file_system strategy,
    whose shm files start with torch's 64-byte refcount header (the
    segment is the whole file, the offset skips the header). Returns the
    tensor.
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("tensorfs.publish: want a torch.Tensor, got %s" % type(tensor).__name__)
    if tensor.device.type != "cpu":
        raise ValueError("tensorfs.publish: only CPU tensors can be published")
    dtype = _canonical(str(tensor.dtype))
    storage = _untyped_storage(tensor)
    if not storage.is_shared():
        tensor.share_memory_()
        storage = _untyped_storage(tensor)
    nbytes = storage.nbytes() if hasattr(storage, "nbytes") else storage.size()
    fd, owned, header = _storage_fd(storage, nbytes)
    shape = tuple(tensor.shape)
    stride = tuple(tensor.stride())
    offset = header // tensor.element_size() + tensor.storage_offset()
    plain = (offset == 0 and tensor.is_contiguous()
             and tensor.numel() * tensor.element_size() == nbytes)
    mount, rel = _resolve(path, mount)
    try:
        with Client(mount) as c:
            c.import_fd(fd, rel, dtype, shape if plain else None)
    finally:
        if owned:
            _os.close(fd)
    if not plain:
        full = _os.path.join(mount, rel)
        try:
            _os.setxattr(full, XATTR_STRIDE, _format_dims(stride).encode())
            _os.setxattr(full, XATTR_OFFSET, str(offset).encode())
            _os.setxattr(full, XATTR_SHAPE, _format_dims(shape).encode())
        except BaseException:
            _os.unlink(full)
            raise
    return tensor


def all_gather_fds(mount, group, rank, world, fd, *, timeout=None, open_group=False):
    """All-gather descriptors among the world local ranks of group.

    Every rank calls this (own process or connection) with its fd; each gets
    the list of world new fds in rank order (its own included, as a new fd),
    all of which it must close. Only ranks of the caller's uid meet in a
    group, unless every rank passes open_group=True: then any uid that does
    so may join, and receives every rank's fd.
    """
    with Client(mount, timeout) as c:
        return c.all_gather(group, rank, world, fd, open_group)


def broadcast_fd(mount, group, rank, world, root, fd=None, *, timeout=None, open_group=False):
    """Broadcast root's fd to the world ranks of group.

    The root passes fd and gets None; every other rank gets a new fd of
    root's file, which it must close. All return once all ranks joined.
    open_group as for all_gather_fds.
    """
    with Client(mount, timeout) as c:
        return c.broadcast(group, rank, world, root, fd, open_group)
