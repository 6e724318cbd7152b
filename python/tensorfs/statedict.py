"""State dicts in a tensorfs directory: one segment per tensor.

A name "a.b.c" is the segment a/b/c under the directory (subdirectories
made as needed), with its dtype and shape as xattrs; the state dict's
string metadata is the directory's user.safetensors.meta.KEY attributes,
the same that import_safetensors and export_safetensors use.
"""

import mmap as _mmap
import os as _os
import warnings as _warnings

import tensorfs as _tfs

_ST_PREFIX = "user.safetensors."


def _segment_path(name):
    parts = str(name).split(".")
    for p in parts:
        if p in ("", "..") or "/" in p or "\0" in p:
            raise ValueError("tensorfs.save_state_dict: name %r does not make a path "
                             "(empty component, '..', '/' or NUL)" % (name,))
    return parts


def save_state_dict(path, state_dict, metadata=None):
    """Write every tensor (or NumPy array) of state_dict under the directory path.

    A name "a.b.c" becomes the segment path/a/b/c, a contiguous copy of the
    tensor with user.tensor.dtype and user.tensor.shape; existing segments
    of the same names are replaced, others left alone. metadata (a dict of
    strings) replaces the directory's user.safetensors.meta.* attributes;
    attributes an earlier import_safetensors left (the recorded tensor
    order and header) are removed, since they describe another file. A name
    that is also another name's directory ("a" and "a.b") is a ValueError.
    """
    parts = {name: _segment_path(name) for name in state_dict}
    files = {tuple(p) for p in parts.values()}
    for name, p in parts.items():
        for i in range(1, len(p)):
            if tuple(p[:i]) in files:
                raise ValueError("tensorfs.save_state_dict: %r is a tensor and the directory of %r"
                                 % (".".join(p[:i]), name))
    _os.makedirs(path, exist_ok=True)
    for attr in _os.listxattr(path):
        if attr.startswith(_ST_PREFIX):
            _os.removexattr(path, attr)
    for key, value in (metadata or {}).items():
        _os.setxattr(path, _tfs._ST_META + str(key), str(value).encode())
    made = set()
    for name, tensor in state_dict.items():
        p = parts[name]
        d = _os.path.join(path, *p[:-1])
        if d not in made:
            _os.makedirs(d, exist_ok=True)
            made.add(d)
        _tfs.save(_os.path.join(d, p[-1]), tensor)


def load_state_dict(path, device="cpu", mode="r"):
    """Return {name: tensor} for every segment under the directory path, zero-copy.

    Each tensor maps its segment's pages: mode "r" copy-on-write (stores
    stay private), "r+" shared and writable (refused, naming the flag, for
    FROMFD segments). The segments' descriptors and metadata come from the
    control socket's load request, one round trip per 253 segments, with
    the permission checks of open(2); imported and GPU segments are opened
    through the mount. The name of path/a/b/c is "a.b.c". A segment
    without user.tensor.dtype or user.tensor.shape is skipped with a
    warning. device other than "cpu" copies each tensor there
    (tensor.to(device)). The tensors pickle by path through
    torch.multiprocessing.
    """
    from ._torch import open_torch, tensor_on, torch_dtype
    if mode not in ("r", "r+"):
        raise ValueError("tensorfs.load_state_dict: mode must be 'r' or 'r+', not %r" % (mode,))
    write = mode == "r+"
    mount = _tfs.find_mount(path)
    rel = _os.path.relpath(_os.path.abspath(path), mount)
    out = {}
    with _tfs.Client(mount) as c:
        for seg, fd in c.load(rel, write):
            full = _os.path.join(path, seg["name"])
            try:
                if not seg.get("dtype") or not seg.get("shape"):
                    missing = [a for a, k in ((_tfs.XATTR_DTYPE, "dtype"), (_tfs.XATTR_SHAPE, "shape"))
                               if not seg.get(k)]
                    _warnings.warn("tensorfs.load_state_dict: skipping %s: it has no %s"
                                   % (full, " and no ".join(missing)), stacklevel=2)
                    continue
                if fd is None:
                    t = open_torch(full, mode)
                else:
                    m = _tfs._meta_from({_tfs.XATTR_DTYPE: seg["dtype"], _tfs.XATTR_SHAPE: seg["shape"],
                                         _tfs.XATTR_STRIDE: seg.get("stride"),
                                         _tfs.XATTR_OFFSET: seg.get("offset")}, seg["size"])
                    torch_dtype(m.dtype)
                    mm = None
                    if seg["size"]:
                        mm = _mmap.mmap(fd, seg["size"], access=_mmap.ACCESS_WRITE if write else _mmap.ACCESS_COPY)
                    t = tensor_on(mm, m, full, write)
            finally:
                if fd is not None:
                    _os.close(fd)
            if device != "cpu":
                t = t.to(device)
            out[seg["name"].replace("/", ".")] = t
    return out
