"""safe_open: the safetensors reading API over a tensorfs directory or a file.

Code written for safetensors runs on tensorfs by changing its import:

    from tensorfs import safe_open            # was: from safetensors import safe_open
    with safe_open("/mnt/t/model", framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)               # zero-copy: the segment's pages
        rows = f.get_slice("wte.weight")[:10]  # a view, no copy either
        meta = f.metadata()

A directory (an imported checkpoint, a saved state dict) gives one tensor
per segment, named as load_state_dict names them; a .safetensors file
(anywhere) is mapped once and read as safetensors reads it. Mappings are
copy-on-write (stores stay private), made when the file is opened; no page
is read before a tensor is used.
"""

from __future__ import annotations

import mmap as _mmap
import os as _os
import typing as _typing

import tensorfs as _tfs

from . import safetensors as _st
from . import statedict as _sd

_FRAMEWORKS = {"pt": "pt", "torch": "pt", "np": "np", "numpy": "np"}


class _Entry(_typing.NamedTuple):
    mm: _typing.Optional[_mmap.mmap]
    at: int  # byte offset of the tensor's storage in mm
    meta: _tfs.TensorMeta
    path: str
    ident: tuple
    pack: _typing.Optional[tuple] = None  # a file of many tensors' (st_ino, st_size), which a pickled tensor is checked against


class safe_open:
    """Open a tensorfs directory or a safetensors file for reading, as safetensors.safe_open.

    framework is "pt" (torch tensors) or "np" (NumPy arrays); device other
    than "cpu" copies each tensor there. Use as a context manager or call
    close(); tensors handed out stay valid after it.
    """

    def __init__(self, filename: str, framework: str = "pt", device: str = "cpu"):
        if framework not in _FRAMEWORKS:
            raise ValueError("tensorfs.safe_open: framework must be 'pt' or 'np', not %r" % (framework,))
        self._framework, self._device, self._path = _FRAMEWORKS[framework], str(device), filename
        self._entries = {}
        if _os.path.isdir(filename):
            self._open_dir(filename)
        else:
            self._open_file(filename)

    def _open_dir(self, path):
        entries, pack = _sd._listing(path, False)
        packed = [e for e in entries if e.at is not None]
        try:
            got = _sd._map_all([e for e in entries if e.at is None], False, lambda e, mm, ident: (e, mm, ident))
        except BaseException:
            if pack is not None:
                _os.close(pack.fd)
            raise
        mm, pack_ident = _sd._map_pack(pack, False) if pack is not None else (None, None)
        for e, mm_, ident in got:
            self._entries[e.name] = _Entry(mm_, 0, e.meta, e.full, ident)
        for e in packed:
            self._entries[e.name] = _Entry(mm, e.at, e.meta, e.full, None, pack_ident)
        meta = _tfs.metadata(path)
        self._metadata = meta or None

    def _open_file(self, path):
        with open(path, "rb") as f:
            size = _os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if n < 0 or n > _st._MAX_HEADER or n > size - 8:
                raise _st._bad("%s: bad header length" % path)
            tensors, meta = _st.parse_header(f.read(n), size - 8 - n)
            mm = _mmap.mmap(f.fileno(), size, access=_mmap.ACCESS_COPY) if size else None
            st = _os.fstat(f.fileno())
        self._metadata = meta
        for name, dt, shape, begin, end in tensors:
            m = _tfs.TensorMeta(_st._FROM_ST[dt], tuple(shape), None, 0, end - begin)
            self._entries[name] = _Entry(mm, 8 + n + begin, m, path, (st.st_dev, st.st_ino, st.st_size),
                                         (st.st_ino, st.st_size))

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Forget the mappings; tensors already handed out keep theirs."""
        self._entries = {}

    def keys(self) -> "list[str]":
        """The tensor names, sorted."""
        return sorted(self._entries)

    def metadata(self) -> "_typing.Optional[dict[str, str]]":
        """The string metadata ("__metadata__", or the directory's), None when there is none."""
        return dict(self._metadata) if self._metadata else None

    def _entry(self, name):
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError("tensorfs.safe_open: no tensor %r in %s" % (name, self._path)) from None

    def get_tensor(self, name: str) -> _typing.Any:
        """The tensor name: a torch tensor ("pt") or NumPy array ("np") on the mapped pages."""
        e = self._entry(name)
        if self._framework == "np":
            return self._numpy(e)
        t = self._torch(e)
        return t if self._device == "cpu" else t.to(self._device)

    def get_slice(self, name: str) -> "_Slice":
        """A lazy handle on tensor name: get_shape(), get_dtype(), and [slicing] for a view."""
        self._entry(name)
        return _Slice(self, name)

    def _torch(self, e):
        from ._torch import _register, _element_size, _torch, tensor_on, torch_dtype
        if e.at == 0:
            return tensor_on(e.mm, e.meta, e.path, False, e.ident)
        torch = _torch()
        tdt, pack = torch_dtype(e.meta.dtype)
        if e.meta.nbytes == 0 or e.mm is None:
            return tensor_on(None, e.meta, e.path, False)
        shape = tuple(e.meta.shape)
        if pack != 1:
            shape = shape[:-1] + (shape[-1] // pack,)
        size = _element_size(tdt)
        if e.at % size:  # misaligned in the file: the one case that copies
            base = torch.frombuffer(e.mm, dtype=torch.uint8)
            return base[e.at:e.at + e.meta.nbytes].clone().view(tdt).reshape(shape)
        base = _register(e.mm, e.path, False, e.ident, pack=e.pack)
        return base[:len(e.mm) // size * size].view(tdt).as_strided(shape, _tfs._contiguous(shape), e.at // size)

    def _numpy(self, e):
        np = _tfs._np()
        ndt = _tfs._numpy_dtype(e.meta.dtype)
        shape = tuple(e.meta.shape)
        if e.mm is None or _tfs._numel(shape) == 0:
            return np.zeros(shape, dtype=ndt)
        stride = e.meta.stride if e.meta.stride is not None else _tfs._contiguous(shape)
        offset = e.at + e.meta.storage_offset * ndt.itemsize
        return np.ndarray(shape, dtype=ndt, buffer=e.mm, offset=offset,
                          strides=tuple(s * ndt.itemsize for s in stride))


class _Slice:
    """safetensors' PySafeSlice: a tensor's shape and dtype, and views of parts of it."""

    def __init__(self, f, name):
        self._f, self._name = f, name

    def get_shape(self) -> "list[int]":
        return list(self._f._entry(self._name).meta.shape)

    def get_dtype(self) -> str:
        """The safetensors spelling of the dtype ("F32", "BF16")."""
        return _st._TO_ST.get(self._f._entry(self._name).meta.dtype, self._f._entry(self._name).meta.dtype)

    def __len__(self) -> int:
        shape = self.get_shape()
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __getitem__(self, index) -> _typing.Any:
        return self._f.get_tensor(self._name)[index]
