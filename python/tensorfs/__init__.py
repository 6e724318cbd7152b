"""tensorfs client: tensors in a tensorfs mount, zero-copy, from Python.

Every file of a tensorfs mount is one shared-memory segment; its dtype and
shape are the extended attributes ``user.tensor.dtype`` and
``user.tensor.shape`` (and optionally ``user.tensor.stride`` and
``user.tensor.storage_offset``, in elements). NumPy is the one dependency;
PyTorch is imported only by the functions that return or take tensors.

Example::

    import numpy as np, torch, tensorfs
    tensorfs.save("/mnt/t/w", np.arange(12, dtype=np.float32).reshape(3, 4))
    a = tensorfs.open("/mnt/t/w")          # np.memmap on the segment's pages
    a[0, 0] = 42                           # every process mapping /mnt/t/w sees it
    t = tensorfs.open_torch("/mnt/t/w")    # torch view of the same pages
    tensorfs.save_state_dict("/mnt/t/model", model.state_dict())
    sd = tensorfs.load_state_dict("/mnt/t/model")   # zero-copy, one request
    x = torch.randn(1024, 768)
    tensorfs.publish(x, "/mnt/t/x")        # x moves to shared memory that becomes /mnt/t/x
    x.mul_(2)                              # ...and readers of /mnt/t/x see the change

Tensors that live in a mount (open_torch, load_state_dict, publish) cross
torch.multiprocessing queues and DataLoader workers by path, not by
descriptor (see tensorfs.reductions).

Control-socket operations (publish, import_fd, export_fd, load_state_dict,
all_gather_fds, broadcast_fd) raise ``OSError(errno, message)`` with the
daemon's errno and reason when the daemon refuses a request; saves and
loads raise it with the path, the tensor and why (a full mount, a flag, a
daemon that is gone).
"""

from __future__ import annotations

import array as _array
import builtins as _builtins
import collections as _collections
import errno as _errno
import json as _json
import mmap as _mmap
import os as _os
import socket as _socket
import time as _time
import typing as _typing

if _typing.TYPE_CHECKING:  # pragma: no cover
    import numpy

__all__ = [
    "Client",
    "IncompatibleKeys",
    "TensorMeta",
    "all_gather_fds",
    "broadcast_fd",
    "canonical_dtype",
    "check_shape",
    "empty_model",
    "export_fd",
    "export_safetensors",
    "find_mount",
    "import_fd",
    "import_safetensors",
    "load_into",
    "load_state_dict",
    "meta",
    "metadata",
    "open",
    "open_torch",
    "publish",
    "safe_open",
    "save",
    "save_state_dict",
    "socket_path",
]

XATTR_DTYPE = "user.tensor.dtype"
XATTR_SHAPE = "user.tensor.shape"
XATTR_STRIDE = "user.tensor.stride"
XATTR_OFFSET = "user.tensor.storage_offset"
XATTR_FLAGS = "user.tensorfs.flags"
XATTR_SOCKET = "user.tensorfs.socket"


# --- dtypes -----------------------------------------------------------------

def _load_dtypes():
    """Read dtypes.json, the table the Go daemon embeds too (alloc/dtypes.json)."""
    with _builtins.open(_os.path.join(_os.path.dirname(__file__), "dtypes.json")) as f:
        table = _json.load(f)["dtypes"]
    dtypes, names, st_names = {}, {}, {}
    for e in table:
        dtypes[e["name"]] = e
        if e["safetensors"]:
            st_names[e["safetensors"]] = e["name"]
        for alias in [e["name"]] + e["torch_aliases"]:
            names[alias] = names["torch." + alias] = e["name"]
        for alias in e["numpy_aliases"]:
            names[alias] = e["name"]
        for code in e["numpy_codes"]:
            for order in ("", "<", "=", "|"):
                names[order + code] = e["name"]
    return dtypes, names, st_names


DTYPES, _DTYPE_NAMES, _ST_DTYPE_NAMES = _load_dtypes()


def canonical_dtype(name: _typing.Any) -> str:
    """Return tensorfs's canonical spelling of a dtype.

    name is a string, a torch dtype (torch.float32), a NumPy dtype
    (np.dtype("float32")) or NumPy scalar type (np.float32). The same
    spellings as the daemon accepts, from the same table: safetensors'
    as the format writes them ("F32", "BF16", "I8": upper case, matched
    first), PyTorch names and aliases ("float", "torch.half"), NumPy names
    and little-endian codes ("single", "<f4"), case-insensitively.
    TypeError, quoting name as given, otherwise.
    """
    if (name.__module__ if isinstance(name, type) else type(name).__module__) == "numpy":
        name = _np().dtype(name).str  # np.float32 and np.dtype("f4") alike: "<f4", byte order and all
    given = str(name).strip()
    if given in _ST_DTYPE_NAMES:
        return _ST_DTYPE_NAMES[given]
    s = given.encode("utf-8", "surrogateescape").lower().decode("utf-8", "surrogateescape")
    try:
        return _DTYPE_NAMES[s]
    except KeyError:
        raise TypeError("tensorfs: unknown dtype %r" % (name,)) from None


def _itemsize(dtype):
    """Bytes per element of a canonical dtype; None for the packed sub-byte ones."""
    bits = DTYPES[dtype]["bits"]
    return None if bits % 8 else bits // 8


# --- metadata ---------------------------------------------------------------

TensorMeta = _collections.namedtuple("TensorMeta", "dtype shape stride storage_offset nbytes")
TensorMeta.__doc__ = """A segment's tensor metadata: canonical dtype name, shape, stride and
storage_offset (elements; stride None means contiguous) and the segment's size in bytes."""


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


def check_shape(shape: _typing.Any, what: str = "tensorfs") -> tuple:
    """Return shape as a tuple of ints, checked as the daemon checks user.tensor.shape.

    shape is a sequence of ints or a string the daemon accepts: "[3, 4]",
    "(3,)", "3,4", "[]" for a scalar. ValueError prefixed with what, saying
    which part is wrong, for anything else ("3x4", negative dims).
    """
    if isinstance(shape, str):
        body = shape.strip()
        if not body:
            raise ValueError('%s: empty shape, use "[]" for a scalar' % what)
        if body[0] in "[(":
            if len(body) < 2 or body[-1] != {"[": "]", "(": ")"}[body[0]]:
                raise ValueError("%s: unbalanced brackets in shape %r" % (what, shape))
            body = body[1:-1].strip()
        parts = [p.strip() for p in body.split(",")] if body else []
        if len(parts) > 1 and parts[-1] == "":
            parts.pop()  # "(3,)"
    else:
        parts = list(shape)
    dims = []
    for p in parts:
        ok = (isinstance(p, str) and p.isascii() and p.isdigit()) or (
            not isinstance(p, (str, bool, float)) and hasattr(p, "__index__"))
        if not ok or int(p) < 0:
            raise ValueError("%s: %r in shape %r is not a non-negative integer" % (what, p, shape))
        dims.append(int(p))
    return tuple(dims)


def _meta_from(attrs, nbytes):
    """TensorMeta from a dict of the four user.tensor.* values (missing ones absent or None)."""
    dtype = canonical_dtype(attrs.get(XATTR_DTYPE) or "uint8")
    shape = attrs.get(XATTR_SHAPE)
    if shape is not None:
        shape = _parse_dims(shape)
    else:
        shape = (nbytes * 8 // DTYPES[dtype]["bits"],)
    stride = attrs.get(XATTR_STRIDE)
    stride = _parse_dims(stride) if stride else None
    offset = int(attrs.get(XATTR_OFFSET) or 0)
    return TensorMeta(dtype, shape, stride, offset, nbytes)


def meta(path: str) -> TensorMeta:
    """Read a segment's TensorMeta from its xattrs.

    A missing dtype reads as uint8 and a missing shape as one dimension
    spanning the whole segment.
    """
    try:
        nbytes = _os.stat(path).st_size
    except FileNotFoundError as e:
        raise _not_found(e, path) from None
    attrs = {n: _getxattr(path, n) for n in (XATTR_DTYPE, XATTR_SHAPE, XATTR_STRIDE, XATTR_OFFSET)}
    return _meta_from(attrs, nbytes)


def metadata(path: str) -> "dict[str, str]":
    """Return the string metadata of a state dict or safetensors directory.

    save_state_dict(metadata=...) and import_safetensors keep it as the
    directory's user.safetensors.meta.KEY attributes; export_safetensors
    writes it as the file's "__metadata__".
    """
    out = {}
    for name in _os.listxattr(path):
        if name.startswith(_ST_META):
            out[name[len(_ST_META):]] = _os.getxattr(path, name).decode()
    return out


_ST_META = "user.safetensors.meta."


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


def _flags(path):
    return (_getxattr(path, XATTR_FLAGS) or "").split("|")


def _read_only(path):
    """True for a FROMFD segment or one this process may not write."""
    try:
        return "FROMFD" in _flags(path) or not _os.access(path, _os.W_OK)
    except FileNotFoundError as e:
        raise _not_found(e, path) from None


def _not_found(err, path):
    """err, or, for a tensor packed in its directory's pack, a FileNotFoundError that says so."""
    from . import statedict
    d, name = _os.path.split(_os.path.abspath(path))
    pack = _os.path.join(d, statedict.PACK_NAME)
    try:
        opened = statedict._open_regular(pack)
    except OSError:
        return err
    if opened is None:
        return err
    fd, size = opened
    try:
        names = [e[0] for e in statedict._pack_entries(fd, size)]
    except (OSError, ValueError):
        return err
    finally:
        _os.close(fd)
    if name not in names:
        return err
    return FileNotFoundError(_errno.ENOENT, "tensorfs: %s is a tensor packed in %s, not a file of its own: "
                             "load_state_dict(%r) or safe_open(%r) has it" % (path, pack, d, d), path)


def _open_fd(path, write):
    """Open path for mapping; a refusal of a write open names the flag behind it."""
    try:
        return _os.open(path, (_os.O_RDWR if write else _os.O_RDONLY) | _os.O_CLOEXEC)
    except PermissionError as e:
        if write and "FROMFD" in _flags(path):
            raise PermissionError(e.errno, "tensorfs: %s is FROMFD (an imported, read-only segment): "
                                  "open it with mode 'r'" % path, path) from None
        raise


def _map(path, write, nbytes=None):
    """mmap the segment at path: shared and writable, or private (copy-on-write)."""
    fd = _open_fd(path, write)
    try:
        if nbytes is None:
            nbytes = _os.fstat(fd).st_size
        if nbytes == 0:
            return None
        return _mmap.mmap(fd, nbytes, access=_mmap.ACCESS_WRITE if write else _mmap.ACCESS_COPY)
    finally:
        _os.close(fd)


# --- NumPy --------------------------------------------------------------------

def _np():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - numpy is a dependency
        raise ImportError("tensorfs: this needs numpy") from e
    return numpy


def _numpy_dtype(dtype):
    name = DTYPES[dtype]["numpy"]
    if name is None:
        hint = "tensorfs.open_torch()" if DTYPES[dtype]["torch"] else "dtype='uint8' for its raw bytes"
        raise TypeError("tensorfs: numpy has no %s; use %s" % (dtype, hint))
    return _np().dtype(name).newbyteorder("<")


def open(path: str, mode: _typing.Optional[str] = None, *, dtype: _typing.Any = None,
         shape: _typing.Optional[_typing.Sequence[int]] = None) -> "numpy.ndarray":
    """Map the segment at path as a NumPy array, zero-copy (np.memmap).

    dtype, shape, stride and storage_offset come from the segment's xattrs;
    dtype or shape arguments override them (the array then starts at byte 0
    and is contiguous; a missing shape spans the segment). mode is "r+"
    (read-write, shared with every other process), "r" (read-only) or "c"
    (copy-on-write); the default is "r" for FROMFD segments and segments
    this process may not write, else "r+". bfloat16, float8 and packed
    sub-byte segments raise TypeError: use open_torch(), or dtype="uint8".
    """
    if mode is None:
        mode = "r" if _read_only(path) else "r+"
    if mode not in ("r+", "r", "c"):
        raise ValueError("tensorfs.open: mode must be 'r+', 'r' or 'c', not %r" % (mode,))
    np = _np()
    m = meta(path)
    if dtype is not None or shape is not None:
        dt = canonical_dtype(dtype) if dtype is not None else m.dtype
        if shape is None:
            shape = (m.nbytes * 8 // DTYPES[dt]["bits"],)
        m = TensorMeta(dt, tuple(int(d) for d in shape), None, 0, m.nbytes)
    ndt = _numpy_dtype(m.dtype)
    size = ndt.itemsize
    shape, offset = m.shape, m.storage_offset
    stride = m.stride if m.stride is not None else _contiguous(shape)
    if m.nbytes == 0 or _numel(shape) == 0:
        if _numel(shape) != 0:
            raise ValueError("tensorfs.open: %s is empty, shape %r needs data" % (path, shape))
        return np.zeros(shape, dtype=ndt)  # nothing to map: mmap refuses empty files
    if mode == "r+":
        _os.close(_open_fd(path, True))  # the errno of the mount, and the flag that refused
    if stride == _contiguous(shape):
        return np.memmap(path, dtype=ndt, mode=mode, offset=offset * size, shape=shape)
    base = np.memmap(path, dtype=np.uint8, mode=mode)
    # np.ndarray checks that the strided extent fits in the buffer.
    return np.ndarray(shape, dtype=ndt, buffer=base, offset=offset * size,
                      strides=tuple(s * size for s in stride))


def _as_bytes_source(x):
    """Return (buffer, canonical dtype, shape) for a numpy array or torch tensor."""
    if type(x).__module__.split(".")[0] == "torch":
        from . import _torch
        return _torch.tensor_bytes(x)
    np = _np()
    a = np.asarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    try:
        dtype = canonical_dtype(a.dtype.name)
    except TypeError:
        raise TypeError("tensorfs.save: dtype %s has no tensorfs equivalent" % a.dtype) from None
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # np.ascontiguousarray would make a 0-d array 1-d
    return memoryview(a.reshape(-1).view(np.uint8)), dtype, tuple(a.shape)


_SAVE_PREFIX = ".save-"  # temporary names of saves in progress; readers skip them
_ATTR_KEEP = ("user.tensorfs.flags", "user.tensorfs.device")  # set while empty; a save keeps them


def save(path: str, x: _typing.Any, *, allow_outside: bool = False) -> None:
    """Write a NumPy array or torch tensor (a contiguous copy) to path, all or nothing.

    The bytes go into a hidden temporary segment beside path
    (".save-NAME-XXXX"), which gets user.tensor.dtype and user.tensor.shape
    and is renamed over path at the end: readers see the old segment or the
    new one, never a part. The segment's flags and device, if path exists,
    carry over. On any error (a full mount included) nothing is left, and
    the OSError names path, the mount and why. A path outside a tensorfs
    mount is refused (OSError ENOENT) unless allow_outside, which writes an
    ordinary file with the same attributes.
    """
    _check_inside(path, allow_outside, "tensorfs.save")
    buf, dtype, shape = _as_bytes_source(x)
    tmp = _write_temp(path, buf, dtype, shape, "tensorfs.save")
    try:
        _os.rename(tmp, path)
    except OSError as e:
        _unlink_quietly(tmp)
        raise _explain(e, path, "tensorfs.save: %s" % path) from None


def _check_inside(path, allow_outside, what):
    """Refuse path outside a tensorfs mount, unless allow_outside: a write there would go to the disk below."""
    if allow_outside:
        return
    try:
        find_mount(path)
    except OSError as e:
        if e.errno != _errno.ENOENT:
            raise
        raise OSError(_errno.ENOENT, "%s: %s is not inside a tensorfs mount, so this would write ordinary files "
                      "on the filesystem below: name a path in a mount (tensorfs status lists them), or pass "
                      "allow_outside=True" % (what, path), path) from None


def _write_temp(path, buf, dtype, shape, what, tmpdir=None):
    """Write the segment meant for path under a temporary name; return that name.

    The name is in tmpdir, by default path's directory. On failure the
    temporary segment is gone and the OSError says why, naming path.
    """
    d, base = _os.path.split(_os.path.abspath(path))
    d = tmpdir or d
    tmp = _os.path.join(d, "%s%s-%s" % (_SAVE_PREFIX, base[:200], _os.urandom(4).hex()))
    try:
        fd = _os.open(tmp, _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _explain(e, path, "%s: %s" % (what, path)) from None
    try:
        try:
            for name in _ATTR_KEEP:
                old = _getxattr(path, name) if _os.path.lexists(path) else None
                if old is not None and old != _getxattr(tmp, name):
                    value = "|".join(f for f in old.split("|") if f != "FROMFD") if name == XATTR_FLAGS else old
                    if value:
                        _os.setxattr(fd, name, value.encode())
            _write_all(fd, buf)
            _os.setxattr(fd, XATTR_DTYPE, dtype.encode())
            _os.setxattr(fd, XATTR_SHAPE, _format_dims(shape).encode())
        finally:
            _os.close(fd)
    except OSError as e:
        _unlink_quietly(tmp)
        raise _explain(e, path, "%s: %s (%s %s, %s)" % (what, path, dtype, list(shape), _human(len(buf))),
                       need=len(buf)) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _write_all(fd, buf):
    view = memoryview(buf).cast("B")
    while view:
        n = _os.write(fd, view)
        view = view[n:]


def _unlink_quietly(path):
    """Remove a temporary segment of ours, its space free when this returns.

    It is truncated first: the unlink of a file just closed frees its
    pages only once the kernel's release of it reaches the daemon, which
    is after close returned, so a save right after a failed one could
    find the mount still full.
    """
    try:
        _os.truncate(path, 0)
    except OSError:
        pass
    try:
        _os.unlink(path)
    except FileNotFoundError:
        pass


def _human(n):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return "%d bytes" % n if unit == "bytes" else "%.1f %s" % (n, unit)
        n /= 1024


def _explain(err: OSError, path: str, what: str, need: _typing.Optional[int] = None) -> OSError:
    """Return err as a new OSError of the same errno that says what failed and why.

    what names the operation and tensor; need, when known, the bytes it
    needed. The reason is computed here, from the mount's own attributes:
    a full mount (what was needed and what is free, as df shows it), a
    daemon that is gone (ENOTCONN), a FROMFD segment, a NOCREATE or
    EXCLUSIVE directory, a permission, a value the daemon refused.
    """
    e = err.errno
    why = _os.strerror(e) if e else str(err)
    parent = _os.path.dirname(_os.path.abspath(path))
    if e in (_errno.ENOSPC, _errno.EDQUOT):
        mount = _mount_or(parent)
        try:
            st = _os.statvfs(mount)
            avail = st.f_bavail * st.f_frsize
            free, size = _human(avail), _human(st.f_blocks * st.f_frsize)
        except OSError:
            free = size = None
        if need is not None and free is not None:
            needed = _human(need)
            if needed == free:  # rounded alike: say the bytes
                needed, free = "%d bytes" % need, "%d bytes" % avail
            why = "it needs %s and the tensorfs mount %s has %s of %s free" % (needed, mount, free, size)
        else:
            why = "the tensorfs mount %s is full%s" % (mount, " (%s of %s free)" % (free, size) if free else "")
        why += ": see df -h %s; free segments or mount with a larger --capacity" % mount
    elif e == _errno.EINVAL:
        why += (" (the daemon refused a value; `tensorfs set DTYPE SHAPE %s` checks a layout first and says why, "
                "`tensorfs show %s` shows the one it has)" % (path, path))
    elif e == _errno.ENOTCONN:
        why = ("the tensorfs daemon serving %s is gone (ENOTCONN: transport endpoint is not connected): "
               "remount it with tensorfs mount" % path)
    elif e in (_errno.EPERM, _errno.EACCES, _errno.EEXIST, _errno.EROFS):
        where = path if _os.path.isdir(path) else parent  # the directory something was made in
        try:
            target = _flags(path) if _os.path.isfile(path) else []
            dirflags = _flags(where)
        except OSError:
            target, dirflags = [], []
        if "FROMFD" in target:
            why = "%s is FROMFD (an imported, read-only segment)" % path
        elif "NOCREATE" in dirflags:
            why = "%s is NOCREATE: nothing new may be created in it" % where
        elif "EXCLUSIVE" in dirflags and e == _errno.EEXIST:
            why = "%s is EXCLUSIVE: an existing segment is never replaced" % where
        elif e in (_errno.EACCES, _errno.EPERM):
            why += " (permission bits of %s or its directory)" % path
    exc = OSError(e, "%s: %s" % (what, why), path)
    exc.__cause__ = err
    return exc


def _mount_or(path):
    """The mount root holding path, or path itself if none is found."""
    try:
        return find_mount(path)
    except OSError:
        return path


# --- control socket -------------------------------------------------------

_MAX_FDS = 253
_MAX_MSG = 65536


def find_mount(path: str) -> str:
    """Return the root of the tensorfs mount holding path (it need not exist yet).

    A mount whose daemon is gone is OSError ENOTCONN, saying so.
    """
    return _find_socket(path)[0]


def _find_socket(path):
    """Return (root, control socket path) of the mount holding path; see find_mount."""
    d = _os.path.abspath(path)
    try:
        if not _os.path.isdir(d):
            d = _os.path.dirname(d)
    except OSError:
        d = _os.path.dirname(d)
    while True:
        try:
            s = _getxattr(d, XATTR_SOCKET)
            if s:
                return d, s
        except OSError as e:
            if e.errno == _errno.ENOTCONN:
                raise _explain(e, d, "tensorfs: %s" % path) from None
        parent = _os.path.dirname(d)
        if parent == d:
            raise OSError(_errno.ENOENT, "tensorfs: %s is not inside a tensorfs mount" % path, path)
        d = parent


def socket_path(mount: str) -> str:
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


# Requests a client sends again to the daemon that serves the mount now
# when its connection ended before their reply (a daemon restarted, by
# tensorfs restart or by its keeper after a crash): sending one again does
# what it would have done. An import is sent again only if its send
# failed (the daemon read nothing): once read, whether it was made is not
# known, and its error says so.
_RESENDABLE = frozenset({"export", "load", "all_gather", "broadcast", "purge", "pull", "publish", "unpublish"})
_RECONNECT_WAIT = 5.0
_RESENDS = 3  # a daemon may be restarted again while it serves the request sent again


class _ConnectionLost(Exception):
    """The control connection ended where its request may be sent again."""


class Client:
    """One connection to a mount's control socket (requests go one at a time).

    path is the mount's root or any path inside the mount. Use as a context
    manager or call close(). Descriptors returned by its methods are new,
    close-on-exec, and belong to the caller.
    """

    def __init__(self, path, timeout=None):
        self.mount, self._socket = _find_socket(path)
        self.timeout = timeout
        self.sock = self._connect_waiting()

    def _connect(self):
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket)
        except BaseException:
            sock.close()
            raise
        return sock

    def _reconnect(self):
        """Connect again, to the daemon that serves the mount now."""
        self.sock.close()
        self.sock = self._connect_waiting()

    def _connect_waiting(self):
        """Connect, waiting up to _RECONNECT_WAIT seconds for a listener.

        A daemon restarted (tensorfs restart, or its keeper after a crash)
        ends its connections, and its successor listens a moment later.
        """
        deadline = _time.monotonic() + _RECONNECT_WAIT
        while True:
            try:
                return self._connect()
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if _time.monotonic() > deadline:
                    raise type(e)(e.errno, "tensorfs: no daemon serves the control socket of %s (%s) within %g s"
                                  % (self.mount, e.strerror, _RECONNECT_WAIT), self._socket) from None
                _time.sleep(0.02)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, req, fds=(), want=0, filename=None):
        """Send one request (a dict, "v" added) with fds attached.

        Returns (reply dict, the reply's fds); want is the number of fds
        expected, or None for whatever the reply announces.
        """
        msg = _json.dumps(dict(req, v=1)).encode()
        resendable = req.get("op") in _RESENDABLE
        for attempt in range(_RESENDS + 1):
            try:
                data, anc, flags = self._exchange(msg, fds, resendable and attempt < _RESENDS)
                break
            except _ConnectionLost:
                self._reconnect()
        else:
            raise ConnectionError("tensorfs %s: the daemon of %s closed the control connection %d times in a row"
                                  % (req.get("op"), self.mount, _RESENDS + 1))
        got = []
        for level, typ, blob in anc:
            if level == _socket.SOL_SOCKET and typ == _socket.SCM_RIGHTS:
                got.extend(_array.array("i", blob[:len(blob) - len(blob) % 4]))
        try:
            if not data:
                unknown = "; whether %s was imported is not known" % filename if req.get("op") == "import" else ""
                raise ConnectionError("tensorfs %s: the daemon closed the control connection before it answered "
                                      "(it was restarted or stopped)%s" % (req.get("op"), unknown))
            if flags & (_socket.MSG_CTRUNC | _socket.MSG_TRUNC):
                raise OSError(_errno.EMSGSIZE, "tensorfs: reply truncated (out of descriptors?)")
            rep = _json.loads(data)
            if not rep.get("ok"):
                e = int(rep.get("errno") or _errno.EIO)
                msg = "tensorfs %s: %s" % (req.get("op"), rep.get("error") or _os.strerror(e))
                if filename is not None:
                    raise OSError(e, msg, filename)
                raise OSError(e, msg)
            if rep.get("fds", 0) != len(got) or (want is not None and len(got) != want):
                raise OSError(_errno.EPROTO, "tensorfs %s: reply has %d descriptors, want %s"
                              % (req.get("op"), len(got), want))
        except BaseException:
            for fd in got:
                _os.close(fd)
            raise
        return rep, got

    def _exchange(self, msg, fds, resendable):
        """Send msg with fds and return the reply's (data, ancillary data, flags).

        Raises _ConnectionLost where msg may be sent again on a new
        connection: its send failed (the daemon read nothing), or, if
        resendable, the connection ended before a reply.
        """
        try:
            if fds:
                _socket.send_fds(self.sock, [msg], list(fds), _socket.MSG_NOSIGNAL)
            else:
                self.sock.sendmsg([msg], [], _socket.MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError):
            raise _ConnectionLost from None
        try:
            # Not socket.recv_fds: it ignores its flags (MSG_CMSG_CLOEXEC) before Python 3.12.
            data, anc, flags, _ = self.sock.recvmsg(_MAX_MSG, _socket.CMSG_SPACE(_MAX_FDS * 4),
                                                    _socket.MSG_CMSG_CLOEXEC)
        except ConnectionResetError:
            data, anc, flags = b"", [], 0
        if not data and not anc and resendable:
            raise _ConnectionLost
        return data, anc, flags

    def export(self, path, write=False):
        """Return a new fd of the KEEPFD segment at path (relative to the mount root)."""
        return self.request({"op": "export", "path": path, "write": bool(write)}, want=1,
                            filename=path)[1][0]

    def import_fd(self, fd, path, dtype=None, shape=None, *, shown=None):
        """Make fd (regular file or memfd) the read-only FROMFD segment at path, no copy.

        dtype and shape are checked here, with the daemon's rules (one
        dtype table), so that a refusal says why: ValueError or TypeError
        naming shown (default path).
        """
        shown = shown or path
        req = {"op": "import", "path": path}
        if dtype is not None:
            try:
                req["dtype"] = canonical_dtype(dtype)
            except TypeError as e:
                raise TypeError("tensorfs.import_fd: %s: %s" % (shown, e)) from None
        if shape is not None:
            dims = check_shape(shape, "tensorfs.import_fd: %s" % shown)
            req["shape"] = _format_dims(dims)
            if dtype is not None:
                need = -(-DTYPES[req["dtype"]]["bits"] * _numel(dims) // 8)
                have = _os.fstat(fd).st_size
                if need > have:
                    raise ValueError("tensorfs.import_fd: %s: %s %s needs %d bytes, the descriptor holds %d"
                                     % (shown, req["dtype"], list(dims), need, have))
        self.request(req, [fd], filename=path)

    def load(self, path, write=False):
        """Yield (segment, fd) for every segment under the directory path.

        segment is the daemon's dict (name relative to path, size, flags,
        dtype, shape, stride, offset; see ctl/doc.go "load"); fd is a new
        descriptor of its bytes (read-write if write), which the caller
        closes, or None where the daemon hands out none (imported and GPU
        segments: open those through the mount). One request per 253
        segments.
        """
        after = None
        while True:
            req = {"op": "load", "path": path, "write": bool(write)}
            if after is not None:
                req["after"] = after
            rep, fds = self.request(req, want=None, filename=path)
            try:
                segs = rep.get("segments", [])
                for s in segs:
                    i, fd = s.get("fd", -1), None
                    if i >= 0:
                        fd, fds[i] = fds[i], -1  # the caller's from here on
                    yield s, fd
            finally:
                for fd in fds:
                    if fd >= 0:
                        _os.close(fd)
            if not rep.get("more"):
                return
            after = segs[-1]["name"]

    def all_gather(self, group, rank, world, fd, open_group=False):
        """Send fd as rank of group; return the world fds of all ranks, in rank order.

        Groups are the caller's uid's own; open_group=True (on every rank)
        joins the group of that name open to every uid instead.
        """
        req = {"op": "all_gather", "group": group, "rank": int(rank), "world": int(world)}
        if open_group:
            req["open"] = True
        return self.request(req, [fd], want=int(world))[1]

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
        return self.request(req, want=1)[1][0]


def export_fd(path: str, write: bool = False, *, mount: _typing.Optional[str] = None) -> int:
    """Return a descriptor of the KEEPFD segment at path (O_RDWR if write).

    The fd is new and close-on-exec; the caller owns it and must os.close()
    it (mmap it first if you like: a mapping outlives the fd). Refused with
    EPERM unless the segment's flags contain KEEPFD, EACCES without the
    permission open() would need.
    """
    mount, rel = _resolve(path, mount)
    with Client(mount) as c:
        return c.export(rel, write)


def import_fd(fd: int, path: str, dtype: _typing.Any = None, shape: _typing.Any = None, *,
              mount: _typing.Optional[str] = None) -> None:
    """Make fd (a regular file or memfd) the segment at path without a copy.

    The segment is read-only (FROMFD) and lives as long as the daemon that
    holds its own duplicate of fd; fd stays the caller's. dtype and shape
    (a sequence or "[a, b]") become its xattrs. EEXIST if path exists.
    """
    mount, rel = _resolve(path, mount)
    with Client(mount) as c:
        c.import_fd(fd, rel, dtype, shape, shown=path)


def all_gather_fds(path: str, group: str, rank: int, world: int, fd: int, *,
                   timeout: _typing.Optional[float] = None, open_group: bool = False) -> "list[int]":
    """All-gather descriptors among the world local ranks of group.

    path is the mount or any path inside it. Every rank calls this (own
    process or connection) with its fd; each gets the list of world new
    fds in rank order (its own included, as a new fd), all of which it
    must close. Only ranks of the caller's uid meet in a group, unless
    every rank passes open_group=True: then any uid that does so may join,
    and receives every rank's fd.
    """
    with Client(path, timeout) as c:
        return c.all_gather(group, rank, world, fd, open_group)


def broadcast_fd(path: str, group: str, rank: int, world: int, root: int, fd: _typing.Optional[int] = None, *,
                 timeout: _typing.Optional[float] = None, open_group: bool = False) -> _typing.Optional[int]:
    """Broadcast root's fd to the world ranks of group.

    path is the mount or any path inside it. The root passes fd and gets
    None; every other rank gets a new fd of root's file, which it must
    close. All return once all ranks joined. open_group as for
    all_gather_fds.
    """
    with Client(path, timeout) as c:
        return c.broadcast(group, rank, world, root, fd, open_group)


# The torch and state-dict halves import torch, or nothing, only when called.
from ._torch import open_torch, publish  # noqa: E402
from .statedict import IncompatibleKeys, empty_model, load_into, load_state_dict, save_state_dict  # noqa: E402
from .safetensors import export_safetensors, import_safetensors  # noqa: E402
from .safeopen import safe_open  # noqa: E402
