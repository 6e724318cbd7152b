"""State dicts and tensors crossing processes by path, against real mounts.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings

from test_client import PYDIR, TIMEOUT, Child, MountedTests, torch, unavailable

import tensorfs

if torch is not None:
    import torch.multiprocessing as torch_mp


def requests(mount):
    """The daemon's FUSE request counts (user.tensorfs.stats)."""
    return json.loads(os.getxattr(mount, "user.tensorfs.stats"))["requests"]


class _StateDictTests(MountedTests):

    def sample(self):
        return {
            "layer.0.weight": torch.randn(16, 8),
            "layer.0.bias": torch.arange(16, dtype=torch.float64),
            "layer.1.weight": torch.randn(4, 16).to(torch.bfloat16),
            "embed": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "scale": torch.tensor(0.5),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 5),
            "view": torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::2],
        }

    def test_round_trip(self):
        sd = self.sample()
        d = os.path.join(self.dir, "model")
        tensorfs.save_state_dict(d, sd, metadata={"format": "pt", "step": "7"})
        self.assertTrue(os.path.isfile(os.path.join(d, "layer.0.weight")))  # one name, one segment
        self.assertEqual(os.getxattr(os.path.join(d, "layer.1.weight"), "user.tensor.dtype"), b"bfloat16")
        self.assertEqual(tensorfs.metadata(d), {"format": "pt", "step": "7"})
        got = tensorfs.load_state_dict(d)
        self.assertEqual(list(got), list(sd))  # the saved order
        for name, t in sd.items():
            self.assertEqual(got[name].dtype, t.dtype, name)
            self.assertTrue(torch.equal(got[name], t), name)
        # A torch module takes it as it is.
        m = torch.nn.Linear(8, 16)
        m.load_state_dict({"weight": got["layer.0.weight"], "bias": got["layer.0.bias"].float()})
        self.assertTrue(torch.equal(m.weight, sd["layer.0.weight"]))

    def test_zero_copy_modes(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"a.w": torch.zeros(64)})
        private = tensorfs.load_state_dict(d)  # copy-on-write
        shared = tensorfs.load_state_dict(d, mode="r+")
        mapped = tensorfs.open_torch(os.path.join(d, "a.w"), "r+")
        shared["a.w"][3] = 7
        if self.MODE == "passthrough":  # classic: the mount's mapping is a page-cache copy
            self.assertEqual(mapped[3].item(), 7)
        self.assertEqual(tensorfs.load_state_dict(d)["a.w"][3].item(), 7)
        self.assertEqual(private["a.w"][3].item(), 7)  # untouched private pages follow the segment
        private["a.w"][5] = 1  # ...until this process stores into them
        self.assertEqual(tensorfs.load_state_dict(d)["a.w"][5].item(), 0)

    def test_load_costs_no_fuse_request_per_tensor(self):
        d = os.path.join(self.dir, "big")
        sd = {"t.%03d" % i: torch.full((4,), float(i)) for i in range(300)}
        tensorfs.save_state_dict(d, sd)
        before = requests(self.mount.dir)
        got = tensorfs.load_state_dict(d)
        after = requests(self.mount.dir)
        n = sum(after.values()) - sum(before.values())
        self.assertEqual(len(got), 300)
        self.assertTrue(all(got["t.%03d" % i][0].item() == i for i in range(300)))
        # 300 segments over 2 replies of the control socket; the mount
        # sees only find_mount's lookups.
        self.assertLess(n, 20, "FUSE requests during load_state_dict: %s" % {
            k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})

    def test_load_into_costs_no_fuse_request_per_tensor(self):
        # A model of 300 parameters: load_into maps each through the
        # control socket's descriptors and puts it on the module; the
        # mount sees the state dict's key order read and find_mount's
        # lookups, nothing per tensor.
        m = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(150)])
        d = os.path.join(self.dir, "model")
        tensorfs.save_state_dict(d, m.state_dict())
        empty = torch.nn.Sequential(*[torch.nn.Linear(2, 2, device="meta") for _ in range(150)])
        before = requests(self.mount.dir)
        tensorfs.load_into(empty, d)
        after = requests(self.mount.dir)
        n = sum(after.values()) - sum(before.values())
        self.assertTrue(torch.equal(empty[149].weight, m[149].weight))
        self.assertLess(n, 20, "FUSE requests during load_into: %s" % {
            k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})

    def test_load_refusals_and_warnings(self):
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, {"w": torch.ones(3)})
        with open(os.path.join(d, "raw"), "wb") as f:
            f.write(b"12345678")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = tensorfs.load_state_dict(d)
        self.assertEqual(list(got), ["w"])
        self.assertEqual(len(w), 1)
        self.assertIn(os.path.join(d, "raw"), str(w[0].message))
        self.assertIn("user.tensor.dtype", str(w[0].message))
        x = torch.arange(4.0)
        tensorfs.publish(x, os.path.join(d, "pub"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "raw" again
            self.assertTrue(torch.equal(tensorfs.load_state_dict(d)["pub"], x))  # through the mount
        with self.assertRaises(PermissionError) as cm:
            tensorfs.load_state_dict(d, mode="r+")
        self.assertIn("FROMFD", str(cm.exception))
        with self.assertRaises(ValueError):
            tensorfs.save_state_dict(d, {"a": torch.ones(1), "a/b": torch.ones(1)})
        with self.assertRaises(OSError):
            tensorfs.load_state_dict(os.path.join(d, "missing"))

    def test_numpy_and_the_mount_root(self):
        import numpy as np
        sub = os.path.join(self.dir, "np")
        tensorfs.save_state_dict(sub, {"x.y": np.arange(6, dtype=np.int16)})
        self.assertTrue(torch.equal(tensorfs.load_state_dict(sub)["x.y"], torch.arange(6, dtype=torch.int16)))
        # load of the root lists the whole mount.
        want = os.path.relpath(os.path.join(sub, "x.y"), self.mount.dir)
        with tensorfs.Client(self.mount.dir) as c:
            names = []
            for seg, fd in c.load("."):
                names.append(seg["name"])
                if fd is not None:
                    os.close(fd)
        self.assertIn(want, names)

    # --- crossing processes ------------------------------------------------

    # One process tries every sharing strategy with both contexts (each
    # import of torch costs a CPU-second; spawned workers start afresh
    # all the same), the segment written anew before each.
    _DATALOADER = textwrap.dedent("""
        import os, sys, torch, tensorfs
        import torch.multiprocessing as mp
        from torch.utils.data import DataLoader, Dataset

        class Rows(Dataset):
            def __init__(self, path):
                self.path = path
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return {"row": tensorfs.open_torch(self.path, "r+")[i], "i": i}

        if __name__ == "__main__":
            path = sys.argv[1]
            for strategy in ("file_descriptor", "file_system"):
                for ctx in ("fork", "spawn"):
                    tensorfs.save(path, torch.arange(32, dtype=torch.float32).reshape(8, 4))
                    mp.set_sharing_strategy(strategy)
                    say = lambda *a: print(strategy, ctx, *a, flush=True)
                    # Two forked workers; one spawned (each imports torch anew).
                    dl = DataLoader(Rows(path), batch_size=None, num_workers=2 if ctx == "fork" else 1,
                                    multiprocessing_context=ctx, timeout=30)
                    rows = [b["row"] for b in dl]
                    say("rows", [r[0].item() for r in rows])
                    rows[3][1] = -5.0   # the same pages as the segment
                    say("stored", tensorfs.open_torch(path, "r")[3, 1].item())
                    q = mp.get_context(ctx).Queue()
                    q.put(tensorfs.open_torch(path)[2:4])
                    say("queue", q.get(timeout=30)[1].tolist())
                    sd = tensorfs.load_state_dict(os.path.dirname(path))
                    q.put(sd)
                    say("state dict", sorted(q.get(timeout=30)))
                    q.close()   # its feeder thread ends before the next pair forks
                    q.join_thread()
        """)

    def test_dataloader_and_queue_by_path(self):
        p = os.path.join(self.dir, "rows")
        script = os.path.join(tempfile.mkdtemp(), "dl.py")  # spawn re-imports __main__ from a file
        with open(script, "w") as f:
            f.write(self._DATALOADER)
        r = subprocess.run([sys.executable, script, p], capture_output=True,
                           text=True, timeout=4 * TIMEOUT, env=dict(os.environ, PYTHONPATH=PYDIR))
        lines = r.stdout.splitlines()
        for strategy in ("file_descriptor", "file_system"):
            for ctx in ("fork", "spawn"):
                with self.subTest(strategy=strategy, ctx=ctx):
                    said = [l[len(strategy + ctx) + 2:] for l in lines if l.startswith(strategy + " " + ctx + " ")]
                    self.assertEqual(said, ["rows [0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0]",
                                            "stored -5.0", "queue [12.0, -5.0, 14.0, 15.0]",
                                            "state dict ['rows']"], r.stderr)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_reduction_sends_a_path(self):
        from multiprocessing.reduction import ForkingPickler
        p = os.path.join(self.dir, "w")
        tensorfs.save(p, torch.arange(10.0))
        t = tensorfs.open_torch(p, "r+")
        data = bytes(ForkingPickler.dumps(t[2:6]))
        self.assertIn(os.path.abspath(p).encode(), data)
        back = ForkingPickler.loads(data)
        back[0] = 99
        self.assertEqual(t[2].item(), 99)  # the same segment pages, mapped again by path
        plain = torch.arange(3.0)  # not in a mount: torch's own reduction
        torch_mp.set_sharing_strategy("file_system")
        self.assertNotIn(b"tensorfs", bytes(ForkingPickler.dumps(plain)))
        p2 = torch.nn.Parameter(tensorfs.open_torch(p, "r+"))
        self.assertIsInstance(ForkingPickler.loads(ForkingPickler.dumps(p2)), torch.nn.Parameter)


class TestStateDictPassthrough(_StateDictTests, unittest.TestCase):
    MODE = "passthrough"


class TestStateDictClassic(_StateDictTests, unittest.TestCase):
    MODE = "classic"


if __name__ == "__main__":
    unittest.main()


# Loads each directory and mode it is sent (a line "DIR\tMODE"), one
# line of answer each: one process, one import of torch, for every load.
LOAD_AS_USER = """
import sys, tensorfs
for line in sys.stdin:
    d, mode = line.rstrip("\\n").split("\\t")
    try:
        print("ok", " ".join(sorted(tensorfs.load_state_dict(d, mode=mode))), flush=True)
    except OSError as e:
        print("errno", e.errno, e, flush=True)
"""


class TestLoadPermissions(MountedTests, unittest.TestCase):
    """load_state_dict as another uid on an --allow-other mount: open(2)'s rules."""

    ARGS = ("--allow-other",)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.chmod(cls.mount.tmp, 0o755)

    def as_nobody(self, d, mode="r"):
        if not hasattr(self, "_nobody"):
            self._nobody = Child(LOAD_AS_USER, user="nobody", group="nogroup", extra_groups=[])
            self.addCleanup(self._nobody.close)
        self._nobody.send(d + "\t" + mode)
        return self._nobody.line()

    def tree(self, name, modes):
        d = os.path.join(self.mount.dir, name)
        tensorfs.save_state_dict(d, {k: torch.ones(2) for k in modes})
        for k, m in modes.items():
            os.chmod(os.path.join(d, k), m)
        return d

    def test_pack_checks_like_open(self):
        if PYDIR.startswith("/root") or os.stat(PYDIR).st_mode & 0o005 != 0o005:
            unavailable("%s is not readable by other users" % PYDIR)
        d = os.path.join(self.mount.dir, "packed")
        tensorfs.save_state_dict(d, {"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(64)}, pack_below=64)
        pack = os.path.join(d, "packed.safetensors")
        self.assertEqual(self.as_nobody(d), "ok a b c")
        out = self.as_nobody(d, "r+")  # the pack is 0644: not for another uid to write
        self.assertTrue(out.startswith("errno 13") and "read and write" in out, out)
        os.chmod(pack, 0o600)
        out = self.as_nobody(d)
        self.assertTrue(out.startswith("errno 13") and "packed.safetensors: no read permission" in out, out)

    def test_load_checks_like_open(self):
        if PYDIR.startswith("/root") or os.stat(PYDIR).st_mode & 0o005 != 0o005:
            unavailable("%s is not readable by other users" % PYDIR)
        d = self.tree("readable", {"a.w": 0o644, "b": 0o444})
        self.assertEqual(self.as_nobody(d), "ok a.w b")
        out = self.as_nobody(d, "r+")
        self.assertTrue(out.startswith("errno 13") and "read and write" in out, out)
        d = self.tree("secret", {"a.w": 0o644, "b": 0o600})
        out = self.as_nobody(d)
        self.assertTrue(out.startswith("errno 13") and "b: no read permission" in out, out)
        d = self.tree("unlisted", {"a.w": 0o644})
        os.mkdir(os.path.join(d, "sub"))
        tensorfs.save(os.path.join(d, "sub", "w"), torch.ones(2))
        os.chmod(os.path.join(d, "sub"), 0o711)  # search, but no listing
        out = self.as_nobody(d)
        self.assertTrue(out.startswith("errno 13") and "listing" in out, out)
        os.chmod(os.path.join(d, "sub"), 0o700)  # neither listing nor search
        self.assertTrue(self.as_nobody(d).startswith("errno 13"))
