#!/usr/bin/env python3
"""Tests scripts/deb-extract.py on .debs made here: python3 scripts/deb-extract_test.py"""

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXTRACT = os.path.join(HERE, "deb-extract.py")


def ar(path, members):
    """Writes an ar archive (a .deb's container) of [(name, bytes)]."""
    with open(path, "wb") as f:
        f.write(b"!<arch>\n")
        for name, data in members:
            f.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode())
            f.write(data + (b"\n" if len(data) % 2 else b""))


def make_deb(path, files, block_size):
    """Writes a .deb whose data.tar.xz holds files {name: bytes}, compressed
    in xz blocks of block_size bytes of tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    xz = subprocess.run(["xz", "-c", "-T1", f"--block-size={block_size}"], input=buf.getvalue(),
                        capture_output=True, check=True).stdout
    ar(path, [("debian-binary", b"2.0\n"), ("control.tar.xz", b""), ("data.tar.xz", xz)])


class DebExtract(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.deb = os.path.join(self.dir, "p.deb")
        self.out = os.path.join(self.dir, "out")
        os.mkdir(self.out)
        # Files in the first and the last of many blocks, and between.
        self.files = {f"./usr/share/filler{i}": os.urandom(50_000) for i in range(6)}
        self.files["./usr/include/cuda.h"] = b"/* cuda.h */\n" * 1000
        self.files.update({f"./usr/share/more{i}": os.urandom(50_000) for i in range(6)})
        self.files["./usr/lib/x86_64-linux-gnu/stubs/libcuda.so"] = os.urandom(70_000)

    def extract(self, *patterns):
        return subprocess.run([sys.executable, EXTRACT, self.deb, self.out, *patterns],
                              capture_output=True, text=True)

    def test_extracts_from_blocks(self):
        make_deb(self.deb, self.files, 1 << 15)
        r = self.extract("./usr/include/cuda.h", "./usr/lib/*/stubs/libcuda.so", "./usr/share/more3")
        self.assertEqual(r.returncode, 0, r.stderr)
        for name in ("./usr/include/cuda.h", "./usr/lib/x86_64-linux-gnu/stubs/libcuda.so", "./usr/share/more3"):
            with open(os.path.join(self.out, name)) as f:
                self.assertEqual(f.buffer.read(), self.files[name], name)
        self.assertEqual(sorted(os.listdir(os.path.join(self.out, "usr"))), ["include", "lib", "share"])

    def test_single_block_is_left_to_the_caller(self):
        make_deb(self.deb, self.files, 1 << 30)
        r = self.extract("./usr/include/cuda.h")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("single block", r.stderr)
        self.assertEqual(os.listdir(self.out), [])

    def test_missing_member_is_left_to_the_caller(self):
        make_deb(self.deb, self.files, 1 << 15)
        r = self.extract("./usr/include/cuda.h", "./usr/include/nothere.h")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("nothere.h", r.stderr)
        self.assertEqual(os.listdir(self.out), [])

    def test_parent_path_refused(self):
        self.files["./usr/lib/../../../escaped/stubs/libcuda.so"] = b"x"
        del self.files["./usr/lib/x86_64-linux-gnu/stubs/libcuda.so"]
        make_deb(self.deb, self.files, 1 << 15)
        r = self.extract("./usr/lib/*/stubs/libcuda.so")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("refusing", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "escaped")))

    def test_truncated_is_left_to_the_caller(self):
        make_deb(self.deb, self.files, 1 << 15)
        with open(self.deb, "r+b") as f:
            f.truncate(os.path.getsize(self.deb) // 2)
        r = self.extract("./usr/include/cuda.h")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(os.listdir(self.out), [])

    def test_not_a_deb(self):
        with open(self.deb, "wb") as f:
            f.write(b"not an archive at all")
        r = self.extract("./usr/include/cuda.h")
        self.assertEqual(r.returncode, 3, r.stderr)


if __name__ == "__main__":
    unittest.main()
