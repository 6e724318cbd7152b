#!/usr/bin/env python3
"""Extracts named files from a .deb without decompressing all of it.

    deb-extract.py DEB DESTDIR PATTERN...

A PATTERN matches a path as the package's data tarball names it, as tar's
--wildcards do (./usr/lib/*/stubs/libcuda.so); each must match one regular
file, which is written under DESTDIR. The data tarball of a large package is
an xz stream of many independent blocks (dpkg compresses with threads), and
its index says where each block starts: this reads the index, then decodes
blocks one at a time, alternately from the front and the back (headers sit
near one end or the other: nvidia-cuda-dev's cuda.h near the front, its stub
library near the end), until every pattern has matched. nvidia-cuda-dev is
2.7 GiB of tar: decoding all of it (dpkg-deb --fsys-tarfile | tar -x) took
45 CPU-seconds; its cuda.h and stub library take two blocks of 24 MiB.

Exits 3, having written nothing, when the .deb is not laid out so (one xz
stream of several blocks, a block size a multiple of the tar's 512), cannot
be read so (truncated, corrupt) or a pattern matches nothing this way (a GNU
long name): the caller then extracts the usual way, which says what is
wrong; 1 for a path that climbs out of DESTDIR.
"""

import fnmatch
import lzma
import os
import struct
import sys

TAR_BLOCK = 512


class Unsupported(Exception):
    """The .deb is not laid out as this reader expects."""


def ar_member(f, name):
    """Returns (offset, size) of the ar member name in the .deb open as f."""
    if f.read(8) != b"!<arch>\n":
        raise Unsupported("not an ar archive")
    while True:
        hdr = f.read(60)
        if len(hdr) < 60:
            raise Unsupported(f"no {name} member")
        member = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        if member == name:
            return f.tell(), size
        f.seek(size + (size & 1), os.SEEK_CUR)


def varint(buf, pos):
    """Decodes xz's multibyte integer at buf[pos:]; returns (value, next pos)."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def xz_blocks(f, start, size):
    """Returns [(compressed offset, unpadded size, uncompressed offset,
    uncompressed size)] of each block of the xz stream at f[start:start+size]."""
    f.seek(start)
    header = f.read(12)
    f.seek(start + size - 12)
    footer = f.read(12)
    if header[:6] != b"\xfd7zXZ\x00" or footer[10:] != b"YZ":
        raise Unsupported("data.tar.xz is not one xz stream")
    index_size = (struct.unpack("<I", footer[4:8])[0] + 1) * 4
    f.seek(start + size - 12 - index_size)
    index = f.read(index_size)
    if index[0] != 0:
        raise Unsupported("no xz index where the footer says")
    count, pos = varint(index, 1)
    blocks, coff, uoff = [], start + 12, 0
    for _ in range(count):
        unpadded, pos = varint(index, pos)
        usize, pos = varint(index, pos)
        blocks.append((coff, unpadded, uoff, usize))
        coff += (unpadded + 3) & ~3
        uoff += usize
    if len(blocks) < 2 or coff != start + size - 12 - index_size:
        raise Unsupported("xz stream padding or a single block")
    if any(b[3] % TAR_BLOCK for b in blocks[:-1]):
        raise Unsupported("xz blocks that split the tar's 512-byte records")
    return blocks


def decode_block(f, block):
    """Returns the uncompressed bytes of one xz block (LZMA2, as dpkg writes)."""
    coff, unpadded, _, usize = block
    f.seek(coff)
    raw = f.read(unpadded)
    header_size = (raw[0] + 1) * 4
    flags = raw[1]
    if flags & 0x03 != 0:  # one filter: LZMA2, nothing before it (no BCJ, delta)
        raise Unsupported("an xz block with more than one filter")
    pos = 2
    if flags & 0x40:
        _, pos = varint(raw, pos)
    if flags & 0x80:
        _, pos = varint(raw, pos)
    filter_id, pos = varint(raw, pos)
    if filter_id != 0x21:
        raise Unsupported("an xz block not compressed with LZMA2")
    d = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 30}])
    out = d.decompress(raw[header_size:], max_length=usize)
    if len(out) != usize:
        raise ValueError(f"an xz block decoded to {len(out)} bytes, its index says {usize}")
    return out


class Tarball:
    """The uncompressed tar, read through the blocks it is decoded from."""

    def __init__(self, f, blocks):
        self.f, self.blocks, self.cache = f, blocks, {}

    def read(self, off, n):
        out = bytearray()
        while n > 0:
            i = self.block_at(off)
            data = self.decoded(i)
            start = off - self.blocks[i][2]
            chunk = data[start:start + n]
            out += chunk
            off += len(chunk)
            n -= len(chunk)
        return bytes(out)

    def block_at(self, off):
        for i, b in enumerate(self.blocks):
            if b[2] <= off < b[2] + b[3]:
                return i
        raise ValueError(f"offset {off} is past the tar's end")

    def decoded(self, i):
        if i not in self.cache:
            self.cache[i] = decode_block(self.f, self.blocks[i])
        return self.cache[i]


def header_at(data, pos):
    """Returns (name, size) of the ustar header at data[pos:], else None."""
    h = data[pos:pos + TAR_BLOCK]
    if len(h) < TAR_BLOCK or h[257:262] != b"ustar" or h[156:157] not in (b"0", b"\x00"):
        return None
    name = h[:100].split(b"\0", 1)[0]
    prefix = h[345:500].split(b"\0", 1)[0]
    if prefix:
        name = prefix + b"/" + name
    try:
        size = int(h[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None
    if sum(h[:148]) + 8 * 32 + sum(h[156:]) != int(h[148:156].split(b"\0", 1)[0].strip() or b"0", 8):
        return None  # not a header: its checksum does not hold
    return name.decode(errors="replace"), size


def ends_first(n):
    """Yields 0..n-1 alternately from the front and the back."""
    lo, hi = 0, n - 1
    while lo <= hi:
        yield lo
        if hi != lo:
            yield hi
        lo, hi = lo + 1, hi - 1


def find(tar, patterns):
    """Scans the blocks, ends first, for a header that matches each pattern;
    returns {pattern: (name, data offset, size)} of those matched."""
    found = {}
    for i in ends_first(len(tar.blocks)):
        data, base = tar.decoded(i), tar.blocks[i][2]
        matched = False
        for pos in range(0, len(data), TAR_BLOCK):
            h = header_at(data, pos)
            if not h:
                continue
            for p in patterns:
                if p not in found and fnmatch.fnmatchcase(h[0], p):
                    found[p] = (h[0], base + pos + TAR_BLOCK, h[1])
                    matched = True
        if not matched:
            del tar.cache[i]  # kept only where a member starts, to read it from
        if len(found) == len(patterns):
            break
    return found


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    deb, dest, patterns = argv[1], argv[2], argv[3:]
    with open(deb, "rb") as f:
        try:
            start, size = ar_member(f, "data.tar.xz")
            tar = Tarball(f, xz_blocks(f, start, size))
            found = find(tar, patterns)
            missing = [p for p in patterns if p not in found]
            if missing:
                raise Unsupported(f"no regular file matches {', '.join(missing)} in a plain tar header")
        except (Unsupported, EOFError, IndexError, ValueError, struct.error, lzma.LZMAError) as e:
            print(f"deb-extract: {deb}: {e}", file=sys.stderr)
            return 3
        for name, _, _ in found.values():
            if ".." in name.split("/"):
                print(f"deb-extract: {deb}: refusing the path {name}", file=sys.stderr)
                return 1
        for name, off, n in found.values():
            out = os.path.join(dest, os.path.normpath(name).lstrip("/"))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out + ".part", "wb") as w:
                w.write(tar.read(off, n))
            os.replace(out + ".part", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
