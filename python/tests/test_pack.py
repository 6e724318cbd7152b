"""Packed state dicts (save_state_dict's pack_below) against real mounts.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import unittest
import warnings

from test_client import PYDIR, TIMEOUT, Child, MountedTests, binary, torch
from test_statedict import requests

import tensorfs
from tensorfs import safetensors as st

if torch is not None:
    from multiprocessing.reduction import ForkingPickler

PACK = "packed.safetensors"

# Loads a directory r+ and sets one element of one tensor, for each line
# "DIR\tNAME\tINDEX\tVALUE" it is sent; answers the tensor's sum.
WRITER = """
import sys, tensorfs
for line in sys.stdin:
    d, name, i, v = line.rstrip("\\n").split("\\t")
    t = tensorfs.load_state_dict(d, mode="r+")[name]
    t.view(-1)[int(i)] = float(v)
    print(t.sum().item(), flush=True)
"""


def read(path):
    """The bytes of the file at path."""
    with open(path, "rb") as f:
        return f.read()


def header(path):
    """The safetensors header of the file at path, as a dict."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


class _PackTests(MountedTests):

    def sample(self):
        return {
            "embed": torch.randn(64, 64),  # 16 KiB: a segment of its own
            "layer.0.weight": torch.randn(16, 8),
            "layer.0.bias": torch.arange(16, dtype=torch.float64),
            "layer.1.weight": torch.randn(4, 16).to(torch.bfloat16),
            "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "scale": torch.tensor(0.5),
            "mask": torch.tensor([True, False, True]),
            "bytes": torch.arange(5, dtype=torch.uint8),
            "empty": torch.zeros(0, 5),
            "view": torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::2],
        }

    def assert_same(self, got, want):
        self.assertEqual(list(got), list(want))  # the saved order
        for name, t in want.items():
            self.assertEqual(got[name].dtype, t.dtype, name)
            self.assertEqual(got[name].shape, t.shape, name)
            self.assertTrue(torch.equal(got[name], t), name)

    def test_round_trip_and_layout(self):
        sd = self.sample()
        sd["tied.a"] = sd["tied.b"] = torch.ones(3)  # one storage: a tie, never packed
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, sd, metadata={"format": "pt"}, pack_below=4096)
        self.assertEqual(sorted(os.listdir(d)), ["embed", PACK, "tied.a", "tied.b"])
        pack = os.path.join(d, PACK)
        self.assertEqual(os.stat(os.path.join(d, "tied.a")).st_ino, os.stat(os.path.join(d, "tied.b")).st_ino)
        self.assertNotIn("user.tensor.dtype", os.listxattr(pack))
        h = header(pack)
        self.assertEqual(sorted(h), sorted(set(sd) - {"embed", "tied.a", "tied.b"}))
        self.assertEqual(h["layer.1.weight"]["dtype"], "BF16")
        data = 8 + struct.unpack("<Q", read(pack)[:8])[0]
        for name, e in h.items():  # each tensor on a whole element of its own dtype
            size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2}.get(e["dtype"], 1)
            self.assertEqual((data + e["data_offsets"][0]) % size, 0, name)
        self.assertEqual(tensorfs.metadata(d), {"format": "pt"})
        for open_ in (tensorfs.open, tensorfs.open_torch):  # a packed name is no file, and the error says where it is
            with self.assertRaises(FileNotFoundError) as cm:
                open_(os.path.join(d, "layer.0.bias"))
            self.assertIn("packed in %s" % pack, str(cm.exception))
        with self.assertRaises(FileNotFoundError) as cm:
            tensorfs.open_torch(os.path.join(d, "nothing"))
        self.assertNotIn("packed", str(cm.exception))
        got = tensorfs.load_state_dict(d)
        self.assert_same(got, sd)
        self.assertIs(got["tied.a"], got["tied.b"])
        with tensorfs.safe_open(d) as f:
            self.assertEqual(f.keys(), sorted(sd))
            self.assertTrue(torch.equal(f.get_tensor("layer.0.bias"), sd["layer.0.bias"]))
            self.assertEqual(f.get_tensor("ids").tolist(), sd["ids"].tolist())
        with tensorfs.safe_open(d, framework="np") as f:
            self.assertEqual(f.get_tensor("ids").tolist(), sd["ids"].tolist())
        tied = tensorfs.load_state_dict(d, tied={"scale.copy": "scale"})  # a name a checkpoint dropped
        self.assertIs(tied["scale.copy"], tied["scale"])

    def test_export_and_import_back(self):
        sd = self.sample()
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, sd, pack_below=1 << 20)
        self.assertEqual(os.listdir(d), [PACK])
        for how in ("python", "cli"):
            out = "/tmp/tensorfs-pack-test-%d-%s.safetensors" % (os.getpid(), how)
            self.addCleanup(lambda p=out: os.path.exists(p) and os.unlink(p))
            if how == "python":
                self.assertEqual(st.export_safetensors(d, out), len(sd))
            else:
                r = subprocess.run([binary(), "export", d, out], capture_output=True, text=True, timeout=TIMEOUT)
                self.assertEqual(r.returncode, 0, r.stderr)
            with tensorfs.safe_open(out) as f:
                self.assertEqual(f.keys(), sorted(sd))
                for name, t in sd.items():
                    self.assertTrue(torch.equal(f.get_tensor(name), t), (how, name))
            back = os.path.join(self.dir, "back-" + how)
            st.import_safetensors(out, back)
            got = tensorfs.load_state_dict(back)
            self.assertEqual(sorted(got), sorted(sd))
            self.assertTrue(all(torch.equal(got[n], t) for n, t in sd.items()))

    def test_import_packed_and_export_identical(self):
        sd = self.sample()
        d = os.path.join(self.dir, "src")
        tensorfs.save_state_dict(d, sd)
        os.link(os.path.join(d, "ids"), os.path.join(d, "ids.tied"))  # a tie: a metadata entry in the file
        src = "/tmp/tensorfs-pack-test-%d.safetensors" % os.getpid()
        back = src + ".back"
        self.addCleanup(lambda: [os.unlink(p) for p in (src, back) if os.path.exists(p)])
        st.export_safetensors(d, src)
        imp = os.path.join(self.dir, "imp")
        self.assertEqual(st.import_safetensors(src, imp, pack_below=1024), len(sd))
        self.assertEqual(sorted(os.listdir(imp)), ["embed", "ids", "ids.tied", PACK])
        self.assertEqual(sorted(header(os.path.join(imp, PACK))), sorted(set(sd) - {"embed", "ids"}))
        got = tensorfs.load_state_dict(imp)
        self.assertIs(got["ids"], got["ids.tied"])
        self.assertTrue(all(torch.equal(got[n], t) for n, t in sd.items()))
        st.export_safetensors(imp, back)  # the recorded header: the same file back
        self.assertEqual(read(back), read(src))
        r = subprocess.run([binary(), "export", imp, back], capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(read(back), read(src))
        for name, why in ((PACK, "name of the pack"), (".save-x", "temporary entries")):
            raw, placed = st.encode_header([(name, "F32", [1])], None)  # a name no load would show as it is
            with open(src, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw + bytes(placed[-1][4]))
            with self.assertRaises(ValueError) as cm:
                st.import_safetensors(src, os.path.join(self.dir, "imp2"), pack_below=1024)
            self.assertIn(why, str(cm.exception))
            self.assertFalse(os.path.exists(os.path.join(self.dir, "imp2")))

    def test_shared_and_private(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"a": torch.zeros(8), "b": torch.zeros(4, 4)}, pack_below=4096)
        private = tensorfs.load_state_dict(d)
        shared = tensorfs.load_state_dict(d, mode="r+")
        shared["b"][1, 2] = 7
        self.assertEqual(tensorfs.load_state_dict(d)["b"][1, 2].item(), 7)
        self.assertEqual(private["b"][1, 2].item(), 7)  # untouched private pages follow the segment
        private["a"][0] = 5  # ...until this process stores into them
        self.assertEqual(tensorfs.load_state_dict(d)["a"][0].item(), 0)
        # Another process writes through its own load; this one sees it.
        child = Child(WRITER)
        self.addCleanup(child.close)
        child.send("\t".join((d, "a", "3", "2.5")))
        self.assertEqual(child.line(), "2.5")
        self.assertEqual(shared["a"][3].item(), 2.5)
        # A packed tensor pickles by the pack's path and its offset, and maps the same pages again.
        data = bytes(ForkingPickler.dumps(shared["b"][1]))
        self.assertIn(os.path.join(os.path.abspath(d), PACK).encode(), data)
        back = ForkingPickler.loads(data)
        self.assertEqual(back.tolist(), shared["b"][1].tolist())
        back[0] = 9
        if self.MODE == "passthrough":  # classic: the mount's mapping is a page-cache copy
            self.assertEqual(shared["b"][1, 0].item(), 9)

    def test_saves_merge_and_move_names(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"a": torch.ones(4), "b": torch.full((4,), 2.0), "big": torch.zeros(4096)},
                                 pack_below=1024)
        self.assertEqual(sorted(os.listdir(d)), ["big", PACK])
        # A second save keeps the pack's other names; "b" grows into a segment, "big" shrinks into the pack.
        tensorfs.save_state_dict(d, {"b": torch.full((1024,), 3.0), "big": torch.full((2,), 4.0),
                                     "c": torch.full((3,), 5.0)}, pack_below=1024)
        self.assertEqual(sorted(os.listdir(d)), ["b", PACK])
        self.assertEqual(sorted(header(os.path.join(d, PACK))), ["a", "big", "c"])
        got = tensorfs.load_state_dict(d)
        self.assertEqual(sorted(got), ["a", "b", "big", "c"])
        self.assertEqual((got["a"].tolist(), got["big"].tolist(), got["c"].tolist()),
                         ([1.0] * 4, [4.0] * 2, [5.0] * 3))
        self.assertEqual(got["b"].sum().item(), 3072)
        # A save without pack_below replaces packed names with segments, and removes an emptied pack.
        tensorfs.save_state_dict(d, {"a": torch.ones(2), "big": torch.ones(2), "c": torch.ones(2)})
        self.assertEqual(sorted(os.listdir(d)), ["a", "b", "big", "c"])
        self.assertEqual(sorted(tensorfs.load_state_dict(d)), ["a", "b", "big", "c"])

    def test_bad_packs_are_refused(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"a": torch.ones(4), "w": torch.ones(300)}, pack_below=1024)
        pack = os.path.join(d, PACK)
        good = read(pack)
        n = struct.unpack("<Q", good[:8])[0]
        for bad, why in [(b"\xff" * 8 + good[8:], "no header"),
                         (good[:8] + b"[" + good[9:], "does not start"),
                         (good[:-4], "cover"),
                         (good[:8 + n].replace(b'"F32"', b'"X32"') + good[8 + n:], "unknown dtype")]:
            with open(pack, "r+b") as f:
                f.truncate(0)
                f.write(bad)
            with self.assertRaises(ValueError) as cm:
                tensorfs.load_state_dict(d)
            self.assertIn(pack, str(cm.exception))
            self.assertIn(why, str(cm.exception))
            # A save here refuses too, rather than lose the pack's tensors, and changes nothing.
            with self.assertRaises(ValueError) as cm:
                tensorfs.save_state_dict(d, {"b": torch.ones(2)}, pack_below=1024)
            self.assertIn("not a valid pack", str(cm.exception))
            self.assertEqual(sorted(os.listdir(d)), [PACK, "w"])
            self.assertEqual(read(pack), bad)
        with open(pack, "wb") as f:
            f.write(good)
        with self.assertRaises(ValueError) as cm:
            tensorfs.save_state_dict(d, {PACK: torch.ones(2)})
        self.assertIn("packed tensors", str(cm.exception))
        for bad in (-1, 1.5, "4k"):
            with self.assertRaises(ValueError):
                tensorfs.save_state_dict(d, {"b": torch.ones(2)}, pack_below=bad)
        # A tensor's segment of that name (tensorfs.save made it) is no pack: saves go on, packing ones refuse.
        other = os.path.join(self.dir, "other")
        os.mkdir(other)
        tensorfs.save(os.path.join(other, PACK), torch.ones(3))
        tensorfs.save_state_dict(other, {"x": torch.ones(2)})
        with self.assertRaises(ValueError) as cm:
            tensorfs.save_state_dict(other, {"y": torch.ones(2)}, pack_below=64)
        self.assertIn("is not a pack", str(cm.exception))
        self.assertEqual(sorted(os.listdir(other)), ["packed.safetensors", "x"])
        self.assertEqual(sorted(tensorfs.load_state_dict(other)), ["packed.safetensors", "x"])
        # A segment named as a packed tensor wins over it, with a warning.
        tensorfs.save(os.path.join(d, "a"), torch.full((2,), 8.0))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = tensorfs.load_state_dict(d)
        self.assertEqual(got["a"].tolist(), [8.0, 8.0])
        self.assertTrue(any("a segment has that name" in str(x.message) for x in w), [str(x.message) for x in w])

    def test_a_sent_tensor_of_a_rewritten_pack_is_refused(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"m": torch.tensor([1.0, 2, 3]), "n": torch.tensor([4.0, 5, 6])}, pack_below=100)
        loaded = tensorfs.load_state_dict(d, mode="r+")
        before = bytes(ForkingPickler.dumps(loaded["n"]))
        self.assertEqual(ForkingPickler.loads(before).tolist(), [4.0, 5, 6])  # the pack it was loaded from
        tensorfs.save_state_dict(d, {"a": torch.tensor([-7.0, -8, -9])}, pack_below=100)  # a new pack: offsets move
        with self.assertRaises(OSError) as cm:
            ForkingPickler.loads(before)
        self.assertEqual(cm.exception.errno, errno.ESTALE)
        self.assertIn("was replaced since", str(cm.exception))
        again = tensorfs.load_state_dict(d)["n"]
        self.assertEqual(ForkingPickler.loads(bytes(ForkingPickler.dumps(again))).tolist(), [4.0, 5, 6])

    def test_what_is_not_a_pack_does_not_block(self):
        d = os.path.join(self.dir, "m")
        os.mkdir(d)
        os.mkfifo(os.path.join(d, PACK))  # another user's FIFO under the pack's name: opened, it would block
        signal.alarm(30)
        self.addCleanup(signal.alarm, 0)
        tensorfs.save_state_dict(d, {"x": torch.ones(1000)})
        with self.assertRaises(ValueError) as cm:
            tensorfs.save_state_dict(d, {"y": torch.ones(2)}, pack_below=100)
        self.assertIn("is not a pack", str(cm.exception))
        with self.assertRaises(FileNotFoundError):
            tensorfs.open_torch(os.path.join(d, "z"))
        self.assertEqual(sorted(tensorfs.load_state_dict(d)), ["x"])
        self.assertEqual(sorted(os.listdir(d)), [PACK, "x"])

    def test_a_pack_of_names_no_save_writes_is_refused(self):
        d = os.path.join(self.dir, "m")
        os.mkdir(d)
        pack = os.path.join(d, PACK)
        for bad in ("", "../../etc/x", "/abs", ".save-x", PACK, "a//b", "a\0b", "..", "x" * 256):
            raw, placed = st.encode_header([("ok", "F32", [1]), (bad, "F32", [1])], None)
            with open(pack, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw + bytes(placed[-1][4]))
            for load in (tensorfs.load_state_dict, tensorfs.safe_open):
                with self.assertRaises(ValueError) as cm:
                    load(d)
                self.assertIn(pack, str(cm.exception))
                self.assertIn(repr(bad), str(cm.exception))
        # A tensor not on a whole element of its dtype: named, as views must be aligned.
        raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}}'
        raw += b" " * (-len(raw) % 8)
        with open(pack, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + bytes(5))
        with self.assertRaises(ValueError) as cm:
            tensorfs.load_state_dict(d)
        self.assertIn("tensor 'b' (float32) starts at byte", str(cm.exception))

    def test_a_packed_name_is_no_directory(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"x": torch.ones(1), "p/q": torch.ones(1)}, pack_below=100)
        for sd in ({"x/y": torch.ones(100)}, {"x/y": torch.ones(1)}, {"p": torch.ones(1)}):
            with self.assertRaises(ValueError) as cm:
                tensorfs.save_state_dict(d, sd, pack_below=100)
            self.assertIn("directory of", str(cm.exception))
        tensorfs.save(os.path.join(d, "seg"), torch.ones(2))
        with self.assertRaises(ValueError):
            tensorfs.save_state_dict(d, {"seg/y": torch.ones(1)}, pack_below=100)
        self.assertEqual(sorted(tensorfs.load_state_dict(d)), ["p/q", "seg", "x"])
        tensorfs.save_state_dict(d, {"x": torch.ones(3)}, pack_below=100)  # the name itself, again: fine
        self.assertEqual(tensorfs.load_state_dict(d)["x"].tolist(), [1.0, 1.0, 1.0])

    def test_load_into_a_meta_model(self):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, m.state_dict(), pack_below=2048)  # the biases and the norm packed
        self.assertEqual(sorted(os.listdir(d)), ["0.weight", "2.weight", PACK])
        empty = tensorfs.empty_model(torch.nn.Sequential, torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                     torch.nn.Linear(64, 8))
        self.assertEqual(tensorfs.load_into(empty, d), ([], []))
        x = torch.randn(3, 64)
        self.assertTrue(torch.equal(empty(x), m(x)))

    def test_one_request_per_load(self):
        d = os.path.join(self.dir, "m")
        sd = {"t.%03d" % i: torch.full((4,), float(i)) for i in range(1000)}
        tensorfs.save_state_dict(d, sd, pack_below=4096)
        before = requests(self.mount.dir)
        got = tensorfs.load_state_dict(d)
        after = requests(self.mount.dir)
        self.assertEqual([got["t.%03d" % i][0].item() for i in range(1000)], [float(i) for i in range(1000)])
        n = sum(after.values()) - sum(before.values())
        self.assertLess(n, 20, "FUSE requests during load_state_dict: %s" % {
            k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})


class TestPackHeader(unittest.TestCase):
    """The header parser every pack goes through, on bytes anyone who may write the pack chose."""

    def test_mutated_headers_are_value_errors(self):
        import random
        raw, placed = st.encode_header([("a", "F32", [4, 4]), ("b.c", "BF16", [3]), ("d", "BOOL", [0])], {"k": "v"})
        size = placed[-1][4]
        self.assertEqual(len(st.parse_header(raw, size)[0]), 3)
        rng = random.Random(28)
        alphabet = b'{}[]",:0123456789-.eE ntrufalsF32BOOL\\'
        for i in range(3000):
            b = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(b))
                op = rng.randrange(3)
                if op == 0:
                    b[at] = rng.choice(alphabet)
                elif op == 1:
                    del b[at]
                else:
                    b.insert(at, rng.choice(alphabet))
            try:
                st.parse_header(bytes(b), size + rng.choice((0, 0, 2, -2)))
            except ValueError:
                pass
        for bad in (b"[" * 100000, b'{"a": ' + b"[" * 100000, b'{"a":{"dtype":"F32","shape":[1],"data_offsets":["x",4]}}',
                    b'{"a":{"dtype":[],"shape":[1],"data_offsets":[0,4]}}', b'{"a":{"dtype":"F32","shape":[true],'
                    b'"data_offsets":[0,4]}}', b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
                    b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}',  # not JSON
                    b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # a lone surrogate
                    b'{"a":{"dtype":"F32","shape":[0,1180591620717411303424],"data_offsets":[0,0]},'
                    b'"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # a dim past int64
                    b'{"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}'):  # a key twice
            with self.assertRaises(ValueError):
                st.parse_header(b"{" + bad[1:] if bad.startswith(b"[") else bad, 4)


class TestPackConcurrentSaves(MountedTests, unittest.TestCase):
    """Saves from several processes into one directory (the lock is the kernel's: one mode is enough)."""

    def test_concurrent_saves_keep_every_tensor(self):
        d = os.path.join(self.dir, "m")
        os.mkdir(d)
        script = textwrap.dedent("""
            import sys, torch, tensorfs
            d, who = sys.argv[1:3]
            for i in range(10):
                tensorfs.save_state_dict(d, {"%s.%d" % (who, i): torch.full((4,), float(i))}, pack_below=100)
            """)
        procs = [subprocess.Popen([sys.executable, "-c", script, d, w], env=dict(os.environ, PYTHONPATH=PYDIR))
                 for w in "abc"]
        self.assertEqual([p.wait(TIMEOUT) for p in procs], [0, 0, 0])
        got = tensorfs.load_state_dict(d)
        self.assertEqual(sorted(got), sorted("%s.%d" % (w, i) for w in "abc" for i in range(10)))
        self.assertEqual(os.listdir(d), [PACK])


class TestPackPassthrough(_PackTests, unittest.TestCase):
    MODE = "passthrough"


class TestPackClassic(_PackTests, unittest.TestCase):
    MODE = "classic"


if __name__ == "__main__":
    unittest.main()
