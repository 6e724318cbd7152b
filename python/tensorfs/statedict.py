"""State dicts in a tensorfs directory: one segment per tensor.

The naming rule, the same for save_state_dict and `tensorfs import`: the
tensor "a.b.c" is the segment DIR/a.b.c, its name verbatim (a "/" in a
name makes a subdirectory, as import does for safetensors names with
"/"). Readers (load_state_dict, load_into, safe_open) name a segment by
its path under DIR; in a directory that neither an import nor
save_state_dict recorded (no user.safetensors.keys, .order or .shards:
the nested layout save_state_dict wrote before, or a tree made by hand)
a "/" reads as ".", so "a/b/c" is still "a.b.c".

Tensors that share storage (the same view of one storage: tied weights)
are stored once: the first name is the segment, the others hard links to
it, and they load back as one tensor under every name. The state dict's
string metadata is the directory's user.safetensors.meta.KEY attributes,
its key order user.safetensors.keys.

With save_state_dict's pack_below, small tensors are instead stored
together in one segment, DIR/packed.safetensors (PACK_NAME): a safetensors
file, with no dtype or shape of its own, whose every tensor is a tensor of
the directory. Loading it takes one descriptor and one mapping, not one of
each per tensor. Readers take a segment of the same name over a packed
entry.
"""

from __future__ import annotations

import collections as _collections
import collections.abc  # noqa: F401  (_collections.abc)
import contextlib as _contextlib
import ctypes as _ctypes
import errno as _errno
import fcntl as _fcntl
import json as _json
import mmap as _mmap
import os as _os
import shutil as _shutil
import stat as _stat
import typing as _typing
import warnings as _warnings
import weakref as _weakref

import tensorfs as _tfs

if _typing.TYPE_CHECKING:  # pragma: no cover
    import torch

_ST_PREFIX = "user.safetensors."
_KEYS_ATTR = _ST_PREFIX + "keys"
_RECORDS = (_KEYS_ATTR, _ST_PREFIX + "order", _ST_PREFIX + "shards")
_TEMPORARY = (".import-", _tfs._SAVE_PREFIX)
PACK_NAME = "packed.safetensors"  # the segment that holds a directory's packed tensors


def _name_problem(name):
    """Why name is not a tensor name of a directory, or None: the rule of saves, imports and packs."""
    parts = name.split("/")
    for p in parts:
        if p in ("", ".", "..") or "\0" in p or len(p.encode()) > 255:
            return "does not make a path (empty component, '.', '..', NUL or over 255 bytes)"
    if parts[0].startswith(_TEMPORARY):
        return "starts with a prefix tensorfs keeps for temporary names (%s)" % ", ".join(_TEMPORARY)
    if parts[0] == PACK_NAME:
        return "is the segment that holds a directory's packed tensors"
    return None


def _prefixes(name):
    """The directories a tensor name makes: "a", "a/b" of "a/b/c"."""
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _check_name(name):
    name = str(name)
    problem = _name_problem(name)
    if problem:
        raise ValueError("tensorfs.save_state_dict: name %r %s" % (name, problem))
    return name


def _tie_key(x):
    """What makes two values the same tensor: one view of one storage; None for others."""
    if type(x).__module__.split(".")[0] == "torch":
        try:
            ptr = x.untyped_storage().data_ptr()  # torch >= 2.0
        except AttributeError:
            ptr = x.storage().data_ptr()
        if ptr == 0 or x.device.type == "meta":
            return None
        return ("torch", str(x.device), ptr, x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
    iface = getattr(x, "__array_interface__", None)
    if iface is None or iface["data"][0] == 0:
        return None
    return ("numpy", iface["data"][0], iface["shape"], iface.get("strides"), iface["typestr"])


def _renameat2():
    libc = _ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
    fn.argtypes = [_ctypes.c_int, _ctypes.c_char_p, _ctypes.c_int, _ctypes.c_char_p, _ctypes.c_uint]
    return fn


_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _rename2(src, dst, flags):
    if _renameat2()(_AT_FDCWD, _os.fsencode(src), _AT_FDCWD, _os.fsencode(dst), flags) != 0:
        e = _ctypes.get_errno()
        raise OSError(e, _os.strerror(e), dst)


def save_state_dict(path: str, state_dict: _typing.Mapping[str, _typing.Any],
                    metadata: _typing.Optional[_typing.Mapping[str, str]] = None, *,
                    pack_below: int = 0, allow_outside: bool = False) -> None:
    """Write every tensor (or NumPy array) of state_dict under the directory path, all or nothing.

    The tensor "a.b.c" becomes the segment path/a.b.c, a contiguous copy
    with user.tensor.dtype and user.tensor.shape; names that are one view
    of one storage (tied weights) become one segment, the later names hard
    links to the first. Existing segments of the same names are replaced,
    others left alone. metadata (a dict of strings) replaces the
    directory's user.safetensors.meta.* attributes, the key order goes to
    user.safetensors.keys, and what an earlier import recorded is removed,
    since it describes another file.

    pack_below (bytes) stores each tensor of fewer bytes, tied to no other
    name, in one segment instead: path/packed.safetensors, a safetensors
    file whose tensors load_state_dict, load_into, safe_open and export
    read as the directory's (one descriptor and one mapping for all of
    them, where a segment each costs one of each). Packed tensors are not
    files of their own: no getfattr, open or mmap by their names. The
    entries of an earlier pack that this save does not name stay in it; a
    name saved now as a segment leaves the pack, and one packed now
    replaces its segment. A save that packs writes a new pack: tensors
    loaded from the old one keep its pages (with mode "r+", their stores
    no longer reach the directory), and one sent to another process then
    fails to unpickle, saying so. Saves into one directory take turns (a
    lock on it), so that none drops another's packed tensors.

    Everything is written under a hidden temporary directory in path
    first, then moved into place (an existing segment is exchanged, and
    exchanged back if a later step fails): on any error, a full mount
    included, path is left as it was, and the OSError names the tensor,
    the mount and why. A name that is also another's directory ("a" and
    "a/b") is a ValueError. A path outside a tensorfs mount is refused
    (OSError ENOENT) unless allow_outside.
    """
    _tfs._check_inside(path, allow_outside, "tensorfs.save_state_dict")
    if type(pack_below) is not int or pack_below < 0:
        raise ValueError("tensorfs.save_state_dict: pack_below must be a number of bytes, not %r" % (pack_below,))
    names = [_check_name(k) for k in state_dict]
    files = set(names)
    for n in names:
        for p in _prefixes(n):
            if p in files:
                raise ValueError("tensorfs.save_state_dict: %r is a tensor and the directory of %r" % (p, n))
    created = not _os.path.isdir(path)
    if created:
        try:
            _os.makedirs(path)
        except OSError as e:
            raise _tfs._explain(e, path, "tensorfs.save_state_dict: %s" % path) from None
    with _locked(path):
        _save_locked(path, state_dict, metadata, pack_below, names, files, created)


def _save_locked(path, state_dict, metadata, pack_below, names, files, created):
    """save_state_dict's work, under the directory's lock."""
    for n in names:
        if _os.path.isdir(_os.path.join(path, n)):
            raise IsADirectoryError(_errno.EISDIR, "tensorfs.save_state_dict: %s is a directory, "
                                    "tensor %r cannot replace it" % (_os.path.join(path, n), n))
    ties = _collections.Counter(k for k in map(_tie_key, state_dict.values()) if k is not None)
    tmp, moved, old_attrs = None, [], None
    old_pack = _open_pack(_os.path.join(path, PACK_NAME))
    try:
        _check_prefixes(path, files, () if old_pack is None else [e[0] for e in old_pack[1]])
        try:
            tmp = _mkdtemp(path)
        except OSError as e:
            raise _tfs._explain(e, path, "tensorfs.save_state_dict: %s" % path) from None
        first, packed = {}, []
        for name, value in state_dict.items():
            dst = _os.path.join(tmp, name)
            if "/" in name:
                _os.makedirs(_os.path.dirname(dst), exist_ok=True)
            key = _tie_key(value)
            if key is not None and key in first:
                _os.link(_os.path.join(tmp, first[key]), dst)
                continue
            if key is not None:
                first[key] = name
            buf, dtype, shape = _tfs._as_bytes_source(value)
            if memoryview(buf).nbytes < pack_below and ties[key] < 2 and _packable(dtype):
                packed.append((name, dtype, shape, buf))
                continue
            seg = _tfs._write_temp(_os.path.join(path, name), buf, dtype, shape,
                                   "tensorfs.save_state_dict: tensor %r" % name, _os.path.dirname(dst))
            _os.rename(seg, dst)
        if packed and old_pack is None and _os.path.lexists(_os.path.join(path, PACK_NAME)):
            raise ValueError("tensorfs.save_state_dict: %s is not a pack (a tensor's segment, or not a regular "
                             "file): rename it to pack tensors here" % _os.path.join(path, PACK_NAME))
        pack = _write_pack(path, tmp, old_pack, packed, files)
        old_attrs = _replace_attrs(path, metadata, list(state_dict))
        gone = [n for n, _, _, _ in packed] + ([PACK_NAME] if pack is _REMOVE else [])
        for name in list(state_dict) + ([PACK_NAME] if pack is _WRITE else []):
            src, dst = _os.path.join(tmp, name), _os.path.join(path, name)
            if not _os.path.lexists(src):  # packed
                continue
            if "/" in name:
                _os.makedirs(_os.path.dirname(dst), exist_ok=True)
            try:
                if _os.path.lexists(dst):
                    _rename2(src, dst, _RENAME_EXCHANGE)  # the old segment waits in tmp
                    moved.append((name, True))
                else:
                    _rename2(src, dst, _RENAME_NOREPLACE)
                    moved.append((name, False))
            except OSError as e:
                raise _tfs._explain(e, dst, "tensorfs.save_state_dict: tensor %r" % name) from None
        for i, name in enumerate(gone):  # segments whose names are packed now, or an emptied pack
            dst = _os.path.join(path, name)
            if _os.path.lexists(dst):
                aside = ".gone-%d" % i
                _rename2(dst, _os.path.join(tmp, aside), _RENAME_NOREPLACE)
                moved.append((name, aside))
    except BaseException:
        _undo(path, tmp, moved, old_attrs, created)
        raise
    finally:
        if old_pack is not None:
            _os.close(old_pack[0])
    _shutil.rmtree(tmp, ignore_errors=True)  # the replaced segments


@_contextlib.contextmanager
def _locked(path):
    """Hold the directory path's lock (flock): saves into one directory take turns.

    A save reads the directory's pack and writes it back with its own
    tensors added; two at once would each drop the other's.
    """
    try:
        fd = _os.open(path, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
    except OSError as e:
        raise _tfs._explain(e, path, "tensorfs.save_state_dict: %s" % path) from None
    try:
        _fcntl.flock(fd, _fcntl.LOCK_EX)
        yield
    finally:
        _os.close(fd)


def _check_prefixes(path, saving, packed):
    """ValueError where a name saved now and one that stays would be a tensor and the other's directory.

    packed: the names in the directory's pack, which stay unless saved now.
    """
    staying = set(packed) - saving
    for n in saving:
        for p in _prefixes(n):
            if p in saving:
                continue  # refused earlier, as one state dict's
            if p in staying or (_os.path.lexists(_os.path.join(path, p)) and not _os.path.isdir(_os.path.join(path, p))):
                raise ValueError("tensorfs.save_state_dict: %r is a tensor in %s and would be the directory of %r"
                                 % (p, path, n))
    for k in staying:
        for p in _prefixes(k):
            if p in saving:
                raise ValueError("tensorfs.save_state_dict: %r would be a tensor and the directory of %r, which "
                                 "%s holds in its pack" % (p, k, path))


# --- packs ------------------------------------------------------------------

_WRITE, _REMOVE = "write", "remove"  # what a save does to the directory's pack


def _packable(dtype):
    """Whether tensors of dtype can go into a pack: a safetensors dtype of whole bytes."""
    from .safetensors import _TO_ST
    return dtype in _TO_ST and _tfs.DTYPES[dtype]["bits"] % 8 == 0


def _open_regular(full):
    """(fd, size) of the regular file at full, opened read-only; None where there is none.

    No symbolic link is followed, and a FIFO or socket there is not
    waited on (O_NONBLOCK): another user may have put one at a name a
    reader looks for. Other errors are raised.
    """
    try:
        fd = _os.open(full, _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NOFOLLOW | _os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (_errno.ENOENT, _errno.ELOOP, _errno.ENXIO):
            return None  # no file, a symbolic link, a socket
        raise
    st = _os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        _os.close(fd)
        return None
    return fd, st.st_size


def _open_pack(full):
    """(fd, [(name, safetensors dtype, shape, byte offset in the file, nbytes)]) of the pack at full, or None.

    None where there is no pack: nothing of that name, or something
    that is not a regular file (_open_regular), or a tensor's segment
    (with a dtype or shape). ValueError for a pack that is not a valid
    safetensors file: a save that went on would lose its tensors.
    """
    try:
        opened = _open_regular(full)
    except OSError as e:
        raise _tfs._explain(e, full, "tensorfs.save_state_dict: reading the pack %s" % full) from None
    if opened is None:
        return None
    fd, size = opened
    try:
        if any(_tfs._getxattr(fd, a) is not None for a in (_tfs.XATTR_DTYPE, _tfs.XATTR_SHAPE)):
            _os.close(fd)
            return None
        try:
            entries = _pack_entries(fd, size)
        except ValueError as e:
            raise ValueError("tensorfs.save_state_dict: %s is not a valid pack (%s): remove it, or move it "
                             "aside, to save here" % (full, e)) from None
        return fd, entries
    except BaseException:
        _os.close(fd)
        raise


_MAX_PACK_HEADER = 100_000_000  # the format's own limit


def _pack_entries(fd, size):
    """[(name, safetensors dtype, shape, byte offset, nbytes)] of the pack of size bytes open at fd.

    ValueError, saying why, for bytes that are not a safetensors file.
    """
    from .safetensors import _bad, parse_header
    n = int.from_bytes(_os.pread(fd, 8, 0), "little") if size >= 8 else -1
    if n < 0 or n > size - 8 or n > _MAX_PACK_HEADER:
        raise _bad("no header that fits in its %d bytes" % size)
    tensors, _ = parse_header(_os.pread(fd, n, 8), size - 8 - n)
    names = [t[0] for t in tensors]
    joined = "\0%s\0" % "\0".join(names)  # what could be wrong with a name, looked for in all at once
    if (joined.count("\0") != len(names) + 1 or "/" in joined or "\0\0" in joined or "\0.\0" in joined
            or "\0..\0" in joined or any("\0" + p in joined for p in _TEMPORARY + (PACK_NAME + "\0",))
            or max(map(len, names), default=0) > 63):
        for name in names:
            problem = _name_problem(name)
            if problem:
                raise _bad("tensor name %r %s" % (name, problem))
    return [(name, st, tuple(shape), 8 + n + begin, end - begin) for name, st, shape, begin, end in tensors]


def _write_pack(path, tmp, old, packed, saving, caller="tensorfs.save_state_dict"):
    """Write tmp/PACK_NAME: the old pack's entries not in saving, then packed [(name, dtype, shape, buffer)].

    Returns _WRITE when there is a new pack to move into place, _REMOVE
    when the old pack is left with no entry, None when it stays as it
    is. Tensors go in the order of their element sizes, largest first,
    so that each starts on a multiple of its own.
    """
    from .safetensors import _FROM_ST, _TO_ST, encode_header
    kept = [] if old is None else [(name, st, shape, (off, nbytes)) for name, st, shape, off, nbytes in old[1]
                                   if name not in saving]
    if not packed and (old is None or len(kept) == len(old[1])):
        return None
    if not packed and not kept:
        return _REMOVE
    tensors = kept + [(name, _TO_ST[dtype], shape, buf) for name, dtype, shape, buf in packed]
    tensors.sort(key=lambda t: (-_tfs.DTYPES[_FROM_ST[t[1]]]["bits"], t[0].encode()))
    header, placed = encode_header([t[:3] for t in tensors], None)
    full = _os.path.join(path, PACK_NAME)
    total = 8 + len(header) + (placed[-1][4] if placed else 0)
    what = "%s: packing %d tensors into %s" % (caller, len(tensors), full)
    fd = _os.open(_os.path.join(tmp, PACK_NAME), _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC, 0o644)
    try:
        _os.ftruncate(fd, total)
        _tfs._write_all(fd, len(header).to_bytes(8, "little") + header)
        for _, _, _, source in tensors:
            if isinstance(source, tuple):  # an entry of the old pack: its bytes
                source = _os.pread(old[0], source[1], source[0])
            _tfs._write_all(fd, source)
    except OSError as e:
        raise _tfs._explain(e, full, "%s (%s)" % (what, _tfs._human(total)), need=total) from None
    finally:
        _os.close(fd)
    return _WRITE


def _mkdtemp(path):
    while True:
        d = _os.path.join(path, "%s%s" % (_tfs._SAVE_PREFIX, _os.urandom(6).hex()))
        try:
            _os.mkdir(d, 0o755)
            return d
        except FileExistsError:
            continue


def _replace_attrs(path, metadata, keys):
    """Set the state dict's attributes on path; return the old ones, to restore."""
    old = {}
    for attr in _os.listxattr(path):
        if attr.startswith(_ST_PREFIX):
            old[attr] = _os.getxattr(path, attr)
    try:
        for attr in old:
            _os.removexattr(path, attr)
        for key, value in (metadata or {}).items():
            _os.setxattr(path, _tfs._ST_META + str(key), str(value).encode())
        _set_json(path, _KEYS_ATTR, keys)
    except OSError as e:
        _restore_attrs(path, old)
        raise _tfs._explain(e, path, "tensorfs.save_state_dict: %s: setting its metadata" % path) from None
    return old


def _restore_attrs(path, old):
    for attr in _os.listxattr(path):
        if attr.startswith(_ST_PREFIX):
            _os.removexattr(path, attr)
    for attr, value in old.items():
        _os.setxattr(path, attr, value)


def _set_json(path, name, value):
    from .safetensors import _set_chunks
    _set_chunks(path, name, _json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def _undo(path, tmp, moved, old_attrs, created):
    """Put path back as save_state_dict found it."""
    if created:
        _shutil.rmtree(path, ignore_errors=True)
        return
    for name, how in reversed(moved):  # how: exchanged, moved in (False) or set aside under a name in tmp
        src, dst = _os.path.join(tmp, name), _os.path.join(path, name)
        try:
            if isinstance(how, str):
                _rename2(_os.path.join(tmp, how), dst, _RENAME_NOREPLACE)
            else:
                _rename2(src if how else dst, dst if how else src, _RENAME_EXCHANGE if how else _RENAME_NOREPLACE)
        except OSError:
            pass  # best effort: the error that brought us here is what the caller sees
    if old_attrs is not None:
        _restore_attrs(path, old_attrs)
    if tmp is not None:
        _shutil.rmtree(tmp, ignore_errors=True)
    for name, how in moved:  # directories made for names with "/" that are empty again
        d = _os.path.dirname(name)
        while d and how is False:
            try:
                _os.rmdir(_os.path.join(path, d))
            except OSError:
                break
            d = _os.path.dirname(d)


# --- loading ----------------------------------------------------------------

# links: 0 unknown; at: the byte offset of a packed tensor in its pack, None for a segment
_Loaded = _collections.namedtuple("_Loaded", "name full meta fd links at", defaults=(None,))
_Pack = _collections.namedtuple("_Pack", "full fd size")
_LAYOUT_ATTRS = (_tfs.XATTR_DTYPE, _tfs.XATTR_SHAPE, _tfs.XATTR_STRIDE, _tfs.XATTR_OFFSET)


def _listing(path, write):
    """([_Loaded], _Pack or None) of the segments and packed tensors under path.

    One control-socket load per 253 segments. Names follow the module's
    naming rule; temporary entries are skipped, and so, with a warning,
    are segments without dtype or shape, and packed tensors that have a
    segment of the same name. The entries are in the saved order, then
    by name. The caller closes the fds, the pack's included.
    """
    with _tfs.Client(path) as c:  # first: a path in no mount fails here, saying so
        keys = _get_json(path, _KEYS_ATTR)
        recorded = keys is not None or any(_tfs._getxattr(path, a) is not None for a in _RECORDS[1:])
        out, metas, pack = [], {}, None
        top = _os.path.abspath(path)
        prefix = _os.path.join(top, "")  # the daemon's names are clean: no join or abspath each
        try:
            for seg, fd in c.load(_os.path.relpath(top, c.mount), write):
                name = seg["name"]
                full = prefix + name
                if name.split("/")[0].startswith(_TEMPORARY):
                    if fd is not None:
                        _os.close(fd)
                    continue
                if not seg.get("dtype") and not seg.get("shape") and name == PACK_NAME:
                    if fd is None:  # imported: through the mount
                        fd = _os.open(full, (_os.O_RDWR if write else _os.O_RDONLY) | _os.O_CLOEXEC)
                    pack = _Pack(full, fd, seg["size"])
                    continue
                if not seg.get("dtype") or not seg.get("shape"):
                    if fd is not None:
                        _os.close(fd)
                    missing = [a for a, k in ((_tfs.XATTR_DTYPE, "dtype"), (_tfs.XATTR_SHAPE, "shape"))
                               if not seg.get(k)]
                    _warnings.warn("tensorfs: skipping %s: it has no %s" % (full, " and no ".join(missing)),
                                   stacklevel=3)
                    continue
                key = (seg["dtype"], seg["shape"], seg.get("stride"), seg.get("offset"), seg["size"])
                m = metas.get(key)
                if m is None:  # parsed once per layout: a model repeats a few
                    m = metas[key] = _tfs._meta_from(dict(zip(_LAYOUT_ATTRS, key)), seg["size"])
                out.append(_Loaded(name if recorded else name.replace("/", "."), full, m, fd, seg.get("links", 0)))
            if pack is not None:
                out += _packed(pack, set(e.name for e in out))
        except BaseException as e:
            _close_fds(out)
            if pack is not None:
                _os.close(pack.fd)
            if isinstance(e, OSError) and e.errno == _errno.ENOTCONN:
                raise _tfs._explain(e, path, "tensorfs: loading %s" % path) from None
            raise
    rank = {k: i for i, k in enumerate(keys or ())}
    out.sort(key=lambda e: (rank.get(e.name, len(rank)), e.name))
    return out, pack


def _packed(pack, segments):
    """[_Loaded] of the tensors in pack, but for the names in segments (warned of)."""
    from .safetensors import _FROM_ST
    try:
        entries = _pack_entries(pack.fd, pack.size)
    except ValueError as e:
        raise ValueError("tensorfs: %s is not a valid pack of tensors: %s" % (pack.full, e)) from None
    out, metas, sizes = [], {}, {}
    for name, st, shape, at, nbytes in entries:
        if name in segments:
            _warnings.warn("tensorfs: skipping %r of %s: a segment has that name" % (name, pack.full), stacklevel=4)
            continue
        m = metas.get((st, shape))
        if m is None:
            m = metas[(st, shape)] = _tfs.TensorMeta(_FROM_ST[st], shape, None, 0, nbytes)
        size = sizes.get(st) or sizes.setdefault(st, _tfs._itemsize(m.dtype) or 1)
        if at % size:
            raise ValueError("tensorfs: %s: tensor %r (%s) starts at byte %d, not on a whole %d-byte element, "
                             "and a pack's tensors are views of it: write the pack again (save_state_dict or "
                             "tensorfs import with a pack)" % (pack.full, name, m.dtype, at, size))
        out.append(_Loaded(name, pack.full, m, None, 1, at))
    return out


def _map_pack(pack, write):
    """(mmap, (st_ino, st_size)) of the pack (shared if write, else copy-on-write); closes its fd."""
    try:
        st = _os.fstat(pack.fd)
        return (_mmap.mmap(pack.fd, pack.size, access=_mmap.ACCESS_WRITE if write else _mmap.ACCESS_COPY),
                (st.st_ino, st.st_size))
    finally:
        _os.close(pack.fd)


def _get_json(path, name):
    from .safetensors import _get_chunks
    raw = _get_chunks(path, name)
    return None if raw is None else _json.loads(raw)


def _map_all(entries, write, with_mapping):
    """Map each segment once (hard links share one mapping); call with_mapping(entry, mm, ident) per name.

    Closes every fd. Returns the list of results in entries' order.
    """
    maps = {}
    results = []
    try:
        for e in entries:
            if e.fd is None:  # imported or GPU segment: through the mount
                st = _os.stat(e.full)
                ident = (st.st_dev, st.st_ino, st.st_size)
                mm = maps.get(ident)
                if mm is None and st.st_size:
                    mm = maps[ident] = _tfs._map(e.full, write and not _tfs._read_only(e.full))
            else:
                st = _os.fstat(e.fd)
                ident = ("fd", st.st_dev, st.st_ino)
                mm = maps.get(ident)
                if mm is None and e.meta.nbytes:
                    mm = maps[ident] = _mmap.mmap(e.fd, e.meta.nbytes,
                                                  access=_mmap.ACCESS_WRITE if write else _mmap.ACCESS_COPY)
            results.append(with_mapping(e, mm, ident))
    finally:
        _close_fds(entries)
    return results


_SLAB_MAX = 1 << 20  # load_state_dict maps segments up to this size side by side in one range


def _slab(entries, write):
    """{id(entry): tensor} for entries (open, small), their segments mapped side by side in one range.

    See _torch.map_slab. Names of one segment (hard links) share its
    slot, and come back as one tensor; a segment the daemon listed with
    one name is not looked at (no fstat).
    """
    if not entries:
        return {}
    from ._torch import map_slab, view_on
    slot, segments, idents = {}, [], []
    for e in entries:
        if e.links == 1:
            ident = id(e)
        else:
            st = _os.fstat(e.fd)
            ident = (st.st_dev, st.st_ino)
        if ident not in slot:
            slot[ident] = len(segments)
            segments.append((e.fd, e.meta.nbytes, e.full))
        idents.append(ident)
    bases, offsets = map_slab(segments, write)
    made, out = {}, {}
    for e, ident in zip(entries, idents):
        i = slot[ident]
        t = made.get((i, e.meta))
        if t is None:
            t = made[(i, e.meta)] = view_on(bases, offsets[i], segments[i][1], e.meta, e.full)
        out[id(e)] = t
    return out


def _close_fds(entries):
    """Close the descriptors of entries."""
    for e in entries:
        if e.fd is not None:
            _os.close(e.fd)


def load_state_dict(path: str, device: str = "cpu", mode: str = "r", *,
                    tied: _typing.Any = None) -> "dict[str, torch.Tensor]":
    """Return {name: tensor} for every segment under the directory path, zero-copy.

    Each tensor maps its segment's pages: mode "r" copy-on-write (stores
    stay private to this process, and a tensor changed so warns when it is
    sent to another process), "r+" shared and writable (refused, naming
    the flag, for FROMFD segments). Names of one segment (ties) come back
    as one tensor. The segments' descriptors and metadata come from the
    control socket's load request, one round trip per 253 segments, with
    the permission checks of open(2); imported and GPU segments are opened
    through the mount. Segments up to 1 MiB are mapped side by side in one
    range, their tensors views of one storage; the range is unmapped when
    the last tensor on it is freed. Names follow the module's rule; the
    order is the saved state dict's, then by name. A segment without user.tensor.dtype
    or user.tensor.shape is skipped with a warning. device other than
    "cpu" copies each tensor there (tensor.to(device)). The tensors pickle
    by path through torch.multiprocessing.

    tied names the ties a checkpoint may have dropped (save_pretrained
    writes one name of each, e.g. no lm_head.weight): a module (its names
    that are one tensor), a mapping {name: other name} or an iterable of
    groups of names. For each group, a name the directory lacks is
    returned as the tensor of a name it has, so that
    module.load_state_dict(load_state_dict(dir, tied=module)) finds every
    key. Ties the directory recorded (hard links, as an import makes from
    the metadata entries safetensors' save_model writes) need no argument.
    """
    from ._torch import tensor_on, torch_dtype, views_on
    if mode not in ("r", "r+"):
        raise ValueError("tensorfs.load_state_dict: mode must be 'r' or 'r+', not %r" % (mode,))
    write = mode == "r+"
    entries, pack = _listing(path, write)
    small, packed, rest = [], [], []
    for e in entries:
        (packed if e.at is not None else
         small if e.fd is not None and 0 < e.meta.nbytes <= _SLAB_MAX and _tfs._numel(e.meta.shape)
         else rest).append(e)
    try:
        for e in entries:
            torch_dtype(e.meta.dtype)
        on_slab = _slab(small, write)
        if pack is not None:
            p, pack = pack, None  # _map_pack closes its fd
            mm, ident = _map_pack(p, write)
            on_slab.update(zip(map(id, packed), views_on(mm, p.full, write, [(e.meta, e.at) for e in packed], ident)))
    except BaseException:
        _close_fds(rest)
        raise
    finally:
        _close_fds(small)
        if pack is not None:
            _os.close(pack.fd)
    made = {}

    def tensor(e, mm, ident):
        key = (ident, e.meta)
        t = made.get(key)
        if t is None:
            t = made[key] = tensor_on(mm, e.meta, e.full, write and not (e.fd is None and _tfs._read_only(e.full)))
        return t

    mapped = iter(_map_all(rest, write, tensor))
    tensors = [on_slab[id(e)] if id(e) in on_slab else next(mapped) for e in entries]
    out = {}
    moved = {}
    for e, t in zip(entries, tensors):
        if device != "cpu":
            t = moved.setdefault(id(t), t.to(device))
        out[e.name] = t
    for group in _tie_groups(tied):
        have = [n for n in group if n in out]
        if have:
            for n in group:
                out.setdefault(n, out[have[0]])
    return out


def _tie_groups(tied):
    """The groups of names that tied (a module, a mapping or an iterable of groups) makes one tensor."""
    if tied is None:
        return []
    if hasattr(tied, "state_dict") and hasattr(tied, "named_parameters"):
        groups = {}
        for name, t in tied.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(name)
        return [g for g in groups.values() if len(g) > 1]
    if isinstance(tied, _collections.abc.Mapping):
        return [(k, v) for k, v in tied.items()]
    groups = [tuple(g) for g in tied]
    if any(isinstance(g, str) for g in tied):
        raise TypeError("tensorfs.load_state_dict: tied= takes a module, a mapping {name: other name} or "
                        "groups of names, not names alone")
    return groups


IncompatibleKeys = _collections.namedtuple("IncompatibleKeys", "missing_keys unexpected_keys")
IncompatibleKeys.__doc__ = "What load_into did not match: as torch's load_state_dict returns it."


def load_into(module: "torch.nn.Module", path: str, *, strict: bool = True, mode: str = "r") -> IncompatibleKeys:
    """Put every parameter and buffer of module on its segment under path, without a copy.

    The module's parameters and persistent buffers become tensors on the
    segments' pages (mode "r": copy-on-write, "r+": shared and writable),
    each parameter a new nn.Parameter with the old one's requires_grad.
    The module may be on any device, "meta" included (build it there, then
    load: no memory for weights twice); what it holds is replaced, never
    copied into. Ties are kept: names that were one Parameter (a tied
    lm_head and embedding) get one new Parameter, and names that are one
    segment one tensor. A name the directory lacks but whose tensor is
    tied to one it has is not missing (as safetensors' load_model treats
    checkpoints written without the tied copy).

    Returns IncompatibleKeys(missing_keys, unexpected_keys); with strict
    (the default) either raises RuntimeError as torch's load_state_dict
    does. A shape or dtype that differs from the module's raises
    RuntimeError naming the tensors (no cast: that would copy), and so
    does a tensor that would stay on the meta device, where a forward pass
    fails: a parameter the directory lacks, or a non-persistent buffer
    (register_buffer(..., persistent=False), which no checkpoint holds;
    build the module with empty_model() to give those real storage). Then
    nothing of module has changed. Works the same on torch 1.13 and 2.x.
    """
    import torch
    sd = load_state_dict(path, mode=mode)
    own = module.state_dict(keep_vars=True)
    persistent = set(own)
    problems = []
    for name, old in own.items():
        t = sd.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(old.shape):
            problems.append("size mismatch for %s: copying a param with shape %s from checkpoint, the shape in "
                            "current model is %s." % (name, tuple(t.shape), tuple(old.shape)))
        elif t.dtype != old.dtype:
            problems.append("dtype mismatch for %s: %s in %s, %s in the module; load_into does not cast "
                            "(that would copy): convert the module first" % (name, t.dtype, path, old.dtype))
    if problems:
        raise RuntimeError("Error(s) in loading state_dict for %s:\n\t%s"
                           % (type(module).__name__, "\n\t".join(problems)))
    new = {}  # id(old tensor) -> what replaces it, so that ties stay ties
    for name, old in own.items():
        if name in sd:
            t = sd[name]
            if isinstance(old, torch.nn.Parameter):
                t = new[id(old)] if id(old) in new else torch.nn.Parameter(t, requires_grad=old.requires_grad)
            new.setdefault(id(old), t)
    missing = [n for n, old in own.items() if id(old) not in new]
    unexpected = [k for k in sd if k not in own]
    if strict and (missing or unexpected):
        msgs = []
        if missing:
            msgs.append("Missing key(s) in state_dict: %s." % ", ".join('"%s"' % k for k in missing))
        if unexpected:
            msgs.append("Unexpected key(s) in state_dict: %s." % ", ".join('"%s"' % k for k in unexpected))
        raise RuntimeError("Error(s) in loading state_dict for %s:\n\t%s" % (type(module).__name__, "\n\t".join(msgs)))
    _refuse_meta(module, path, [n for n in missing if own[n].device.type == "meta"],
                 [n for n, b in module.named_buffers() if n not in persistent and b.device.type == "meta"])
    modules = dict(module.named_modules(remove_duplicate=False))  # one walk, not one per name
    for name, old in own.items():
        if id(old) in new:
            owner, _, attr = name.rpartition(".")
            setattr(modules[owner], attr, new[id(old)])
    return IncompatibleKeys(missing, unexpected)


def _refuse_meta(module, path, params, buffers):
    """RuntimeError naming what load_into would leave on the meta device, if anything."""
    if not params and not buffers:
        return
    lines = ["%s: not in %s" % (n, path) for n in params]
    lines += ["%s: a non-persistent buffer, which no checkpoint holds" % n for n in buffers]
    hint = []
    if buffers:
        hint.append("build the module with tensorfs.empty_model(%s, ...), which puts its parameters on meta and "
                    "gives its buffers real storage from its own initialisation" % type(module).__name__)
    if params:
        hint.append("load a directory that holds every parameter")
    hint = ", or ".join(hint)
    raise RuntimeError("tensorfs.load_into: these would stay on the meta device, where a forward pass fails:\n\t%s\n"
                       "%s%s; nothing of the module has changed" % ("\n\t".join(lines), hint[0].upper(), hint[1:]))


def empty_model(cls: _typing.Callable[..., "torch.nn.Module"], *args: _typing.Any, **kwargs: _typing.Any) -> "torch.nn.Module":
    """Return cls(*args, **kwargs) with every parameter on the meta device and every buffer real.

    The module's own initialisation runs: buffers (a causal mask, position
    ids, rotary tables), persistent or not, get real storage and values,
    while each parameter moves to meta as it is registered (its memory
    freed at once; torch's init functions do nothing on meta), as
    accelerate's init_empty_weights(include_buffers=False) does. Then
    load_into(module, dir) puts the parameters on their segments. Ties made
    in __init__ stay ties. Not thread-safe: it swaps
    torch.nn.Module.register_parameter while cls runs.
    """
    import torch
    register = torch.nn.Module.register_parameter
    moved = {}  # id(real parameter) -> its meta one, while it lives: registered twice, it stays one

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = moved.get(id(param))
            if meta is None:
                meta = moved[id(param)] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                _weakref.finalize(param, moved.pop, id(param), None)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register_on_meta
    try:
        return cls(*args, **kwargs)
    finally:
        torch.nn.Module.register_parameter = register
