"""safetensors files in and out of a tensorfs directory, as the tensorfs CLI
does (`tensorfs import` / `tensorfs export`), from Python.

Import writes one segment per tensor (a name "a/b" is the segment b in the
directory a), with user.tensor.dtype and user.tensor.shape, and records on
the directory what segments cannot hold: user.safetensors.meta.KEY for each
"__metadata__" entry, user.safetensors.order (the names in header order,
JSON) and user.safetensors.header (the original header, only when it is not
the one export would rebuild). Values over 64 KiB are split into NAME,
NAME.1, NAME.2...

Export writes the header as the reference writer (huggingface/safetensors
serialize) lays it out: compact JSON, "__metadata__" first, tensors sorted
by dtype, descending in the reference's Dtype order, then by name, packed
back to back, padded with spaces to a multiple of 8. A directory imported
from a file keeps that file's order (and, when unchanged, its exact header).
"""

import json as _json
import os as _os
import tempfile as _tempfile
import typing as _typing
import warnings as _warnings

import tensorfs as _tfs

_PREFIX = "user.safetensors."
_ORDER_ATTR = _PREFIX + "order"
_HEADER_ATTR = _PREFIX + "header"
_IMPORT_TMP = ".import-"
_MAX_HEADER = 100_000_000
_XATTR_MAX = 64 << 10
_METADATA = "__metadata__"

with open(_os.path.join(_os.path.dirname(__file__), "dtypes.json")) as _f:
    _RANK = {st: i for i, st in enumerate(_json.load(_f)["safetensors_order"])}
_FROM_ST = {e["safetensors"]: name for name, e in _tfs.DTYPES.items() if e["safetensors"]}
_TO_ST = {name: st for st, name in _FROM_ST.items()}
_BITS = {st: _tfs.DTYPES[name]["bits"] for st, name in _FROM_ST.items()}


def _bad(msg):
    return ValueError("not a valid safetensors file: " + msg)


def _nbytes(st, shape):
    bits = _tfs.DTYPES[_FROM_ST[st]]["bits"] * _tfs._numel(shape)
    if bits % 8:
        raise _bad("shape %s of %s is %d bits, not whole bytes" % (list(shape), st, bits))
    return bits // 8


def _pairs(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        raise _bad("key %r appears twice" % next(k for k, _ in pairs if k in seen or seen.add(k)))
    return d


def _utf8(s):
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _no_constant(name):
    raise _bad("%s is not JSON" % name)


_MAX_INT = (1 << 63) - 1  # what a shape's dim or an offset may be, as the Go reader and PyTorch take them


def parse_header(raw, data_size):
    """Parse and validate a header (its JSON bytes) as the reference does.

    Returns (tensors, metadata): tensors a list of (name, dtype, shape,
    begin, end) in header order, metadata a dict or None. Tensors must
    have known dtypes, exactly their bytes, and tile the data_size-byte
    buffer with no gap or overlap. ValueError otherwise.
    """
    if not raw.startswith(b"{"):
        raise _bad("header does not start with '{'")
    try:
        obj = _json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs, parse_constant=_no_constant)
    except (UnicodeDecodeError, _json.JSONDecodeError) as e:
        raise _bad("bad JSON header: %s" % e) from None
    except RecursionError:
        raise _bad("JSON header nested too deep") from None
    meta = obj.pop(_METADATA, None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad("%s is not an object of strings" % _METADATA)
    tensors = []
    for name, info in obj.items():
        try:
            st, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _bad("tensor %r needs dtype, shape and data_offsets [begin, end]" % name) from None
        bits = _BITS.get(st) if type(st) is str else None
        if bits is None:
            raise _bad("tensor %r: unknown dtype %r" % (name, st))
        numel = 1
        ok = type(shape) is list and type(begin) is int and type(end) is int and 0 <= begin <= end <= _MAX_INT
        for d in shape if ok else ():
            if type(d) is not int or not 0 <= d <= _MAX_INT:
                ok = False
                break
            numel *= d
        if not ok:
            raise _bad("tensor %r: bad shape %r or data_offsets [%r, %r]" % (name, shape, begin, end))
        if (end - begin) * 8 != numel * bits:
            raise _bad("tensor %r: %d bytes in data_offsets, %s %s needs %d"
                       % (name, end - begin, st, shape, _nbytes(st, shape)))
        tensors.append((name, st, shape, begin, end))
    try:
        "".join(obj).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("tensor name %r is not UTF-8 (a lone surrogate)" % next(n for n in obj if not _utf8(n))) from None
    at = 0
    for name, _, _, begin, end in sorted(tensors, key=lambda t: (t[3], t[4])):
        if begin != at:
            raise _bad("tensor %r starts at %d of the data buffer, want %d (gap or overlap)" % (name, begin, at))
        at = end
    if at != data_size:
        raise _bad("the tensors cover %d bytes, but the data buffer has %d" % (at, data_size))
    return tensors, meta


def encode_header(tensors, metadata):
    """The reference writer's header for (name, dtype, shape) tensors, in this order.

    Returns (header bytes padded to 8, [(name, dtype, shape, begin, end)]).
    """
    parts, placed, at = [], [], 0
    if metadata:
        parts.append(_json.dumps(_METADATA) + ":" + _json.dumps(dict(sorted(metadata.items())),
                                                                ensure_ascii=False, separators=(",", ":")))
    for name, st, shape in tensors:
        n = _nbytes(st, shape)
        placed.append((name, st, shape, at, at + n))
        parts.append(_json.dumps(name, ensure_ascii=False) + ":" + _json.dumps(
            {"dtype": st, "shape": list(shape), "data_offsets": [at, at + n]}, separators=(",", ":")))
        at += n
    raw = ("{" + ",".join(parts) + "}").encode()
    return raw + b" " * (-len(raw) % 8), placed


def reference_order(tensors):
    """Sort (name, dtype, ...) tuples as the reference writer: dtype descending, then name."""
    return sorted(tensors, key=lambda t: (-_RANK[t[1]], t[0].encode()))


def _get_chunks(path, name):
    try:
        value = _os.getxattr(path, name)
    except OSError:
        return None
    i = 1
    while len(value) % _XATTR_MAX == 0 and value:
        try:
            value += _os.getxattr(path, "%s.%d" % (name, i))
        except OSError:
            break
        i += 1
    return value


def _set_chunks(path, name, value):
    for i in range(max(1, -(-len(value) // _XATTR_MAX))):
        _os.setxattr(path, name if i == 0 else "%s.%d" % (name, i), value[i * _XATTR_MAX:(i + 1) * _XATTR_MAX])


def _copy(src, src_off, dst, dst_off, n):
    while n > 0:
        try:
            k = _os.copy_file_range(src, dst, min(n, 8 << 20), src_off, dst_off)
        except OSError:
            k = _os.pwrite(dst, _os.pread(src, min(n, 8 << 20), src_off), dst_off)
        if k == 0:
            raise OSError("tensorfs: source ended %d bytes early" % n)
        src_off, dst_off, n = src_off + k, dst_off + k, n - k


def import_safetensors(file: str, path: str, *, pack_below: int = 0) -> int:
    """Import the safetensors file into the new or empty directory path, all or nothing.

    Returns the number of tensors. Each tensor becomes a segment named as
    the tensor ("a/b" the segment b in directory a) with its dtype and
    shape; a metadata entry that names a tensor under a name the file does
    not have (safetensors' save_model records a dropped tie so) becomes a
    hard link to that tensor's segment; the
    metadata, the tensor order and, unless export would rebuild it, the
    original header are kept on the directory, so that export_safetensors
    (or `tensorfs export`) writes the file back byte-identical. pack_below
    puts each tensor of fewer bytes that no such entry names in one
    segment, path/packed.safetensors, as save_state_dict's pack_below does.
    """
    from . import statedict as _sd
    if type(pack_below) is not int or pack_below < 0:
        raise ValueError("tensorfs.import_safetensors: pack_below must be a number of bytes, not %r" % (pack_below,))
    with open(file, "rb") as f:
        size = _os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if n < 0 or n > _MAX_HEADER or n > size - 8:
            raise _bad("bad header length in %s" % file)
        raw = f.read(n)
        tensors, meta = parse_header(raw, size - 8 - n)
        names = {t[0] for t in tensors}
        for name in names:
            parts = name.split("/")
            if any(p in ("", ".", "..") or "\0" in p for p in parts) or parts[0].startswith((_IMPORT_TMP, _tfs._SAVE_PREFIX)):
                raise ValueError("tensorfs.import_safetensors: tensor name %r is not a path, or one tensorfs keeps for "
                                 "temporary entries" % name)
            if pack_below and parts[0] == _sd.PACK_NAME:
                raise ValueError("tensorfs.import_safetensors: tensor %r: %s is the name of the pack of the small "
                                 "tensors: import without pack_below" % (name, _sd.PACK_NAME))
            for d in _sd._prefixes(name):
                if d in names:
                    raise ValueError("tensor %r is also the directory of tensor %r" % (d, name))
        links = {k: v for k, v in (meta or {}).items() if k not in names and v in names}
        for k in list(links):
            parts = k.split("/")
            if any(p in ("", ".", "..") or "\0" in p for p in parts) or parts[0].startswith(_IMPORT_TMP) \
                    or any(d in names for d in _sd._prefixes(k)):
                del links[k]
        created = not _os.path.exists(path)
        _tfs.find_mount(path)
        if created:
            _os.makedirs(path)
        elif _os.listdir(path):
            raise OSError("tensorfs.import_safetensors: %s is not empty" % path)
        tmp = moved = None
        try:
            tmp = _tempfile.mkdtemp(prefix=_IMPORT_TMP, dir=path)
            packed = [(name, _FROM_ST[st], tuple(shape), _os.pread(f.fileno(), end - begin, 8 + n + begin))
                      for name, st, shape, begin, end in tensors
                      if end - begin < pack_below and name not in links.values() and _sd._packable(_FROM_ST[st])]
            _sd._write_pack(path, tmp, None, packed, (), "tensorfs.import_safetensors")
            in_pack = {t[0] for t in packed}
            for name, st, shape, begin, end in sorted(tensors, key=lambda t: t[3]):
                if name in in_pack:
                    continue
                seg = _os.path.join(tmp, name)
                _os.makedirs(_os.path.dirname(seg), exist_ok=True)
                fd = _os.open(seg, _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC, 0o644)
                try:
                    _os.ftruncate(fd, end - begin)  # reserves the pages: ENOSPC here, not SIGBUS later
                    _copy(f.fileno(), 8 + n + begin, fd, 0, end - begin)
                    _os.setxattr(fd, _tfs.XATTR_DTYPE, _FROM_ST[st].encode())
                    _os.setxattr(fd, _tfs.XATTR_SHAPE, _tfs._format_dims(shape).encode())
                finally:
                    _os.close(fd)
            for k, v in sorted(links.items()):
                _os.makedirs(_os.path.dirname(_os.path.join(tmp, k)), exist_ok=True)
                _os.link(_os.path.join(tmp, v), _os.path.join(tmp, k))
            for attr in _os.listxattr(path):
                if attr.startswith(_PREFIX):
                    _os.removexattr(path, attr)
            for k, v in (meta or {}).items():
                _os.setxattr(path, _tfs._ST_META + k, v.encode())
            _set_chunks(path, _ORDER_ATTR, _json.dumps([t[0] for t in tensors], ensure_ascii=False,
                                                       separators=(",", ":")).encode())
            if encode_header([t[:3] for t in tensors], meta)[0] != raw:
                _set_chunks(path, _HEADER_ATTR, raw)
            moved = []
            for entry in sorted(_os.listdir(tmp)):
                _os.rename(_os.path.join(tmp, entry), _os.path.join(path, entry))
                moved.append(entry)
            _os.rmdir(tmp)
        except BaseException:
            _rollback(path, tmp, moved, created)
            raise
    return len(tensors)


def _rollback(path, tmp, moved, created):
    import shutil
    if created:
        shutil.rmtree(path, ignore_errors=True)
        return
    for entry in moved or ():
        shutil.rmtree(_os.path.join(path, entry), ignore_errors=True)
        if _os.path.lexists(_os.path.join(path, entry)):
            _os.unlink(_os.path.join(path, entry))
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    for attr in _os.listxattr(path):
        if attr.startswith(_PREFIX):
            _os.removexattr(path, attr)


def _segments(path):
    """{name: (file, dtype, shape, byte offset, identity)} of the exportable tensors under path.

    The name is the path relative to path, or a packed tensor's name in
    path/packed.safetensors; names of one identity are one segment (a
    tie). A file without dtype or shape is skipped with a warning naming
    it, and so is a packed tensor that has a segment of its name.
    """
    from . import statedict as _sd
    segs, pack = {}, None
    for top, dirs, files in _os.walk(path):
        if top == path:
            dirs[:] = [d for d in dirs if not d.startswith(_IMPORT_TMP)]
        dirs.sort()
        for fn in sorted(files):
            full = _os.path.join(top, fn)
            if not _os.path.isfile(full) or _os.path.islink(full):
                continue
            missing = [a for a in (_tfs.XATTR_DTYPE, _tfs.XATTR_SHAPE) if _tfs._getxattr(full, a) is None]
            if len(missing) == 2 and top == path and fn == _sd.PACK_NAME:
                pack = full
                continue
            if missing:
                _warnings.warn("tensorfs.export_safetensors: skipping %s: it has no %s"
                               % (full, " and no ".join(missing)), stacklevel=3)
                continue
            m = _tfs.meta(full)
            if m.dtype not in _TO_ST:
                raise ValueError("tensorfs.export_safetensors: %s: safetensors has no %s" % (full, m.dtype))
            if m.stride is not None and any(s != c for d, s, c in zip(m.shape, m.stride, _tfs._contiguous(m.shape))
                                            if d != 1):
                raise ValueError("tensorfs.export_safetensors: %s: stride %s is not contiguous"
                                 % (full, list(m.stride)))
            st = _TO_ST[m.dtype]
            off = m.storage_offset * (_tfs._itemsize(m.dtype) or 1)
            if off + _nbytes(st, m.shape) > m.nbytes:
                raise ValueError("tensorfs.export_safetensors: %s: %d bytes are too few for %s %s at byte %d"
                                 % (full, m.nbytes, m.dtype, list(m.shape), off))
            ino = _os.stat(full)
            segs[_os.path.relpath(full, path)] = (full, st, list(m.shape), off, (ino.st_dev, ino.st_ino))
    opened = pack and _sd._open_regular(pack)
    if opened:
        fd, size = opened
        try:
            entries = _sd._pack_entries(fd, size)
        except ValueError as e:
            raise ValueError("tensorfs.export_safetensors: %s is not a valid pack of tensors: %s" % (pack, e)) from None
        finally:
            _os.close(fd)
        for name, st, shape, at, _ in entries:
            if name in segs:
                _warnings.warn("tensorfs.export_safetensors: skipping %r of %s: a segment has that name"
                               % (name, pack), stacklevel=3)
            else:
                segs[name] = (pack, st, list(shape), at, (pack, name))  # never a tie
    return segs


def _untie(segs, recorded, tied=()):
    """Keep one name of each segment with several (hard links): never one in tied; the recorded one, else the first.

    Returns (kept segs, {other name: kept name}) without the names in
    tied, as safetensors' _remove_duplicate_names decides which name to
    keep. ValueError for a name in tied that is not one of several names
    of a segment: leaving it out would lose its tensor.
    """
    groups = {}
    for rel, seg in segs.items():
        groups.setdefault(seg[4], []).append(rel)
    tied = set(tied)
    for n in sorted(tied):
        if n not in segs:
            raise ValueError("tensorfs.export_safetensors: tied name %r: no segment of that name to leave out" % n)
        if len(groups[segs[n][4]]) < 2:
            raise ValueError("tensorfs.export_safetensors: tied name %r shares its segment with no other name: "
                             "leaving it out would lose its tensor" % n)
    kept, ties = {}, {}
    for names in groups.values():
        names.sort(key=lambda n: n.encode())
        free = [n for n in names if n not in tied]
        if not free:
            raise ValueError("tensorfs.export_safetensors: tied names %r are every name of one segment: keep one" % names)
        keep = next((n for n in free if n in recorded), free[0])
        kept[keep] = segs[keep]
        ties.update((n, keep) for n in free if n != keep)
    return kept, ties


def export_safetensors(path: str, file: str, *, tied: _typing.Iterable[str] = ()) -> int:
    """Write the segments under the directory path to the safetensors file.

    Returns the number of tensors. Names: the path under path (as
    load_state_dict names them). Order: recorded by an import first, then
    the reference writer's (dtype descending, then name). Names of one
    segment (ties, hard links) are written once, as safetensors' save_model
    writes shared tensors: the recorded name or else the first, the others
    as metadata entries "other": "kept". A name in tied is left out with
    no entry, another name of its segment written, as transformers'
    save_pretrained drops a model's tied weights. Files without dtype or shape are
    skipped with a warning each; a non-contiguous layout or a dtype the
    format lacks is a ValueError. The file is written whole through a
    temporary file renamed into place. (`tensorfs export` does the same,
    and writes sharded checkpoints too.)
    """
    segs = _segments(path)
    recorded = _get_chunks(path, _ORDER_ATTR)
    order = _json.loads(recorded) if recorded is not None else []
    if not segs and recorded is None:
        raise ValueError("tensorfs.export_safetensors: no tensors under %s" % path)
    segs, ties = _untie(segs, set(order), tied)
    meta = _tfs.metadata(path)
    for name, keep in ties.items():
        meta.setdefault(name, keep)
    # (name, dtype, shape, relative path): recorded names first, as recorded.
    first = [(rel, segs[rel][1], segs[rel][2], rel) for rel in dict.fromkeys(order) if rel in segs]
    done = {t[3] for t in first}
    entries = first + reference_order([(rel, st, shape, rel)
                                       for rel, (_, st, shape, _, _) in segs.items() if rel not in done])
    files = {t[0]: t[3] for t in entries}
    if len(files) != len(entries):
        raise ValueError("tensorfs.export_safetensors: two segments under %s have the same name" % path)
    tensors = [t[:3] for t in entries]
    header, placed = encode_header(tensors, meta)
    orig = _get_chunks(path, _HEADER_ATTR)
    if orig is not None:
        try:
            otensors, ometa = parse_header(orig, placed[-1][4] if placed else 0)
        except ValueError:
            otensors = None
        if otensors is not None and [t[:3] for t in otensors] == [tuple(t) for t in tensors] \
                and (ometa or {}) == meta:
            header, placed = orig, otensors
    dirname = _os.path.dirname(_os.path.abspath(file))
    fd, tmp = _tempfile.mkstemp(prefix="." + _os.path.basename(file) + ".tmp-", dir=dirname)
    try:
        _os.write(fd, len(header).to_bytes(8, "little") + header)
        for name, _, _, begin, end in sorted(placed, key=lambda t: t[3]):
            full, _, _, off, _ = segs[files[name]]
            src = _os.open(full, _os.O_RDONLY | _os.O_CLOEXEC)
            try:
                _copy(src, off, fd, 8 + len(header) + begin, end - begin)
            finally:
                _os.close(src)
        _os.fchmod(fd, 0o644)
        _os.fsync(fd)
        _os.close(fd)
        fd = -1
        _os.rename(tmp, file)
    except BaseException:
        if fd >= 0:
            _os.close(fd)
        _os.unlink(tmp)
        raise
    return len(tensors)
