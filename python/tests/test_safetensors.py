"""safetensors in and out of a mount from Python, and the installable package.

The files are written here to the format's specification (8-byte header
length, the JSON header the reference writer lays out, the byte buffer),
with every dtype of the reference implementation.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings

from test_client import PYDIR, REPO, TIMEOUT, MountedTests, binary, np, unavailable

import tensorfs
from tensorfs import safetensors as st

# Every dtype of the reference format and its bits per element.
SPEC_DTYPES = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# The reference enum's order, by which its writer sorts (descending).
SPEC_ORDER = list(SPEC_DTYPES)


def spec_file(tensors, metadata=None, order=None):
    """Bytes of a safetensors file as the reference writer makes it.

    tensors: {name: (dtype, shape, data bytes)}. The writer sorts by dtype
    (descending in the enum's order), then name, unless order is given.
    """
    names = order or sorted(tensors, key=lambda n: (-SPEC_ORDER.index(tensors[n][0]), n.encode()))
    header, at, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = dict(sorted(metadata.items()))
    for n in names:
        dt, shape, b = tensors[n]
        header[n] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + len(b)]}
        at += len(b)
        data += b
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def all_dtypes():
    tensors = {}
    for i, (dt, bits) in enumerate(SPEC_DTYPES.items()):
        shape = [2, 4]  # 8 elements: whole bytes for 4- and 6-bit types
        n = 8 * bits // 8
        tensors["t.%s" % dt.lower()] = (dt, shape, bytes((i * 31 + j) % 256 for j in range(n)))
    tensors["scalar"] = ("F32", [], b"\x00\x00\xc0\x3f")
    tensors["empty"] = ("I64", [0, 3], b"")
    tensors["nested/name"] = ("U8", [3], b"abc")
    return tensors


class TestSafetensorsOffline(unittest.TestCase):
    """Header parsing and writing, no mount needed."""

    def test_reference_layout(self):
        t = all_dtypes()
        data = spec_file(t, {"format": "pt"})
        n = int.from_bytes(data[:8], "little")
        tensors, meta = st.parse_header(data[8:8 + n], len(data) - 8 - n)
        self.assertEqual(meta, {"format": "pt"})
        names = [x[0] for x in tensors]
        self.assertEqual(names, [x[0] for x in st.reference_order([(x[0], x[1]) for x in tensors])])
        raw, _ = st.encode_header([x[:3] for x in tensors], meta)
        self.assertEqual(raw, data[8:8 + n])
        # Same element size, the reference's order: BF16 before F16 before I16.
        self.assertLess(names.index("t.bf16"), names.index("t.f16"))
        self.assertLess(names.index("t.f16"), names.index("t.i16"))

    def test_refusals(self):
        for header, size in [
            (b'{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2),  # 12 bits
            (b'{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,1]}}', 1),
            (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{}}', 1),
            (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', 3),  # bytes left over
            (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),  # a gap
            (b'[]', 0),
        ]:
            with self.subTest(header=header), self.assertRaises(ValueError):
                st.parse_header(header, size)


class _SafetensorsTests(MountedTests):
    NEEDS = ("numpy",)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tmp = tempfile.mkdtemp(prefix="tensorfs-st-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)
        super().tearDownClass()

    def file(self, name, data):
        p = os.path.join(self.tmp, name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def test_round_trip_every_dtype(self):
        t = all_dtypes()
        for label, data in [("reference", spec_file(t, {"format": "pt"})),
                            ("own order", spec_file(t, None, order=sorted(t)))]:
            with self.subTest(label):
                src = self.file(label + ".safetensors", data)
                d = os.path.join(self.mount.dir, "st-" + label.replace(" ", "-"))
                self.assertEqual(tensorfs.import_safetensors(src, d), len(t))
                for name, (dt, shape, b) in t.items():
                    p = os.path.join(d, name)
                    with open(p, "rb") as f:
                        self.assertEqual(f.read(), b, name)
                    self.assertEqual(json.loads(os.getxattr(p, "user.tensor.shape")), shape)
                out = os.path.join(self.tmp, label + ".out")
                tensorfs.export_safetensors(d, out)
                with open(out, "rb") as f:
                    self.assertEqual(f.read(), data)
                # The Go CLI reads what Python recorded, and writes it back the same.
                cli = os.path.join(self.tmp, label + ".cli")
                r = subprocess.run([binary(), "export", d, cli], capture_output=True, text=True,
                                   timeout=TIMEOUT)
                self.assertEqual(r.returncode, 0, r.stderr)
                with open(cli, "rb") as f:
                    self.assertEqual(f.read(), data)

    def test_export_state_dict_order_and_skips(self):
        d = os.path.join(self.mount.dir, "st-sd")
        tensorfs.save_state_dict(d, {"b.f16": np.ones(2, np.float16), "a.i16": np.ones(2, np.int16),
                                     "z": np.ones(1, np.float64)}, metadata={"k": "v"})
        with open(os.path.join(d, "notes"), "wb") as f:
            f.write(b"not a tensor")
        out = os.path.join(self.tmp, "sd.safetensors")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertEqual(tensorfs.export_safetensors(d, out), 3)
        self.assertEqual([str(x.message).split(": ")[1] for x in w], ["skipping " + os.path.join(d, "notes")])
        with open(out, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        self.assertEqual(list(header), ["__metadata__", "z", "b.f16", "a.i16"])  # F64, F16, I16
        want = spec_file({"z": ("F64", [1], np.ones(1).tobytes()), "b.f16": ("F16", [2], np.ones(2, np.float16).tobytes()),
                          "a.i16": ("I16", [2], np.ones(2, np.int16).tobytes())}, {"k": "v"})
        self.assertEqual(data, want)

    def test_import_refuses_and_leaves_nothing(self):
        bad = self.file("bad.safetensors", spec_file({"a": ("U8", [2], b"xy")})[:-1])  # truncated
        d = os.path.join(self.mount.dir, "st-bad")
        with self.assertRaises(ValueError):
            tensorfs.import_safetensors(bad, d)
        self.assertFalse(os.path.exists(d))
        with self.assertRaises(OSError):
            tensorfs.import_safetensors(self.file("ok", spec_file({"a": ("U8", [1], b"x")})), "/proc/x")


class TestSafetensorsPassthrough(_SafetensorsTests, unittest.TestCase):
    MODE = "passthrough"


class TestSafetensorsClassic(_SafetensorsTests, unittest.TestCase):
    MODE = "classic"


class TestInstall(unittest.TestCase):
    """pip install ./python works offline, and tensorfs imports from anywhere."""

    def test_pip_install_into_a_venv(self):
        with tempfile.TemporaryDirectory() as tmp:
            venv = os.path.join(tmp, "venv")
            r = subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                               capture_output=True, text=True, timeout=TIMEOUT)
            if r.returncode != 0:
                unavailable("python3 -m venv failed (apt-get install python3-venv): " + r.stderr)
            py = os.path.join(venv, "bin", "python")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
            r = subprocess.run([py, "-m", "pip", "install", PYDIR], capture_output=True, text=True,
                               timeout=300, env=env, cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = subprocess.run([py, "-c", "import tensorfs, sys; print(tensorfs.__file__); "
                                "print(tensorfs.canonical_dtype('torch.half'))"],
                               capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stderr)
            where, dtype = r.stdout.split()
            self.assertTrue(where.startswith(venv), where)
            self.assertEqual(dtype, "float16")
        self.assertFalse(os.path.exists(os.path.join(REPO, "python", "build")))


if __name__ == "__main__":
    unittest.main()
