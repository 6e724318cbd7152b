"""Models as PyTorch and Hugging Face users keep them, against real mounts:
the naming rule, ties, load_into, safe_open, saves that are all or
nothing, errors with reasons, the copy-on-write divergence warning, and
the memory of 4 workers that load one model.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import errno
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings

from test_client import PYDIR, TIMEOUT, Mount, MountedTests, binary, np, torch, unavailable

import tensorfs

if torch is not None:
    class GPT(torch.nn.Module):
        """A small GPT-style model: tied lm_head and embedding, int64 and bool buffers, a scalar."""

        def __init__(self, vocab=64, dim=16, layers=2, ctx=8, device=None):
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, dim, device=device)
            self.wpe = torch.nn.Embedding(ctx, dim, device=device)
            self.h = torch.nn.ModuleList(torch.nn.Linear(dim, dim, device=device) for _ in range(layers))
            self.ln_f = torch.nn.LayerNorm(dim, device=device)
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False, device=device)
            self.lm_head.weight = self.wte.weight  # tied
            self.register_buffer("position_ids", torch.arange(ctx, device=device))
            self.register_buffer("mask", torch.ones(ctx, ctx, dtype=torch.bool, device=device).tril())
            self.register_buffer("scale", torch.tensor(0.125, device=device))
            self.register_buffer("cache", torch.zeros(4, device=device), persistent=False)


def pss(pid):
    with open("/proc/%d/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss for %d" % pid)


class _ModelTests(MountedTests):

    def path(self, *names):
        return os.path.join(self.dir, *names)

    # --- names -------------------------------------------------------------

    def test_naming_rule(self):
        m = GPT()
        d = self.path("gpt")
        tensorfs.save_state_dict(d, m.state_dict())
        self.assertEqual(sorted(os.listdir(d)), sorted(m.state_dict()))  # flat dotted names
        self.assertEqual(json.loads(os.getxattr(d, "user.safetensors.keys")), list(m.state_dict()))
        self.assertEqual(list(tensorfs.load_state_dict(d)), list(m.state_dict()))
        # A name with "/" is a subdirectory, read back verbatim, as import does.
        tensorfs.save_state_dict(self.path("slash"), {"x/y": torch.ones(2), "z": torch.ones(1)})
        self.assertTrue(os.path.isfile(self.path("slash", "x", "y")))
        self.assertEqual(list(tensorfs.load_state_dict(self.path("slash"))), ["x/y", "z"])
        # The nested layout of older tensorfs (and hand-made trees): "/" reads as ".".
        os.makedirs(self.path("old", "blocks", "0", "fc"))
        tensorfs.save(self.path("old", "blocks", "0", "fc", "weight"), torch.arange(4.0))
        tensorfs.save(self.path("old", "head"), torch.ones(1))
        got = tensorfs.load_state_dict(self.path("old"))
        self.assertEqual(sorted(got), ["blocks.0.fc.weight", "head"])
        with tensorfs.safe_open(self.path("old")) as f:
            self.assertEqual(f.keys(), ["blocks.0.fc.weight", "head"])
        mod = torch.nn.Module()
        mod.head = torch.nn.Parameter(torch.zeros(1))
        mod.blocks = torch.nn.ModuleList([torch.nn.Module()])
        mod.blocks[0].fc = torch.nn.Linear(4, 1, bias=False)
        with self.assertRaises(RuntimeError):  # shape [4] against [1, 4]
            tensorfs.load_into(mod, self.path("old"))

    # --- ties ----------------------------------------------------------------

    def test_ties_stored_once_and_shared(self):
        m = GPT()
        d = self.path("gpt")
        tensorfs.save_state_dict(d, m.state_dict(), metadata={"format": "pt"})
        a, b = os.stat(os.path.join(d, "wte.weight")), os.stat(os.path.join(d, "lm_head.weight"))
        self.assertEqual((a.st_ino, a.st_nlink), (b.st_ino, 2))  # one segment, two names
        sd = tensorfs.load_state_dict(d)
        self.assertIs(sd["wte.weight"], sd["lm_head.weight"])
        # export writes it as safetensors' save_model: once, the first name kept.
        out = os.path.join(tempfile.mkdtemp(), "gpt.safetensors")
        tensorfs.export_safetensors(d, out)
        with tensorfs.safe_open(out) as f:
            self.assertNotIn("wte.weight", f.keys())
            self.assertEqual(f.metadata(), {"format": "pt", "wte.weight": "lm_head.weight"})
        # ...and import makes the tie again.
        back = self.path("back")
        r = subprocess.run([binary(), "import", out, back], capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1 tied", r.stdout)
        self.assertEqual(os.stat(os.path.join(back, "wte.weight")).st_ino,
                         os.stat(os.path.join(back, "lm_head.weight")).st_ino)
        out2 = os.path.join(tempfile.mkdtemp(), "gpt.safetensors")
        tensorfs.export_safetensors(back, out2)
        with open(out, "rb") as f1, open(out2, "rb") as f2:
            self.assertEqual(f1.read(), f2.read())

    # --- load_into -----------------------------------------------------------

    def test_load_into(self):
        src = GPT()
        src.h[0].weight.requires_grad_(False)
        d = self.path("gpt")
        tensorfs.save_state_dict(d, src.state_dict())
        m = tensorfs.empty_model(GPT)
        self.assertEqual(m.wte.weight.device.type, "meta")
        m.h[0].weight.requires_grad_(False)
        keys = tensorfs.load_into(m, d)
        self.assertEqual(keys, tensorfs.IncompatibleKeys([], []))
        self.assertIs(m.lm_head.weight, m.wte.weight)  # the tie is one Parameter again
        self.assertIsInstance(m.wte.weight, torch.nn.Parameter)
        self.assertFalse(m.h[0].weight.requires_grad)
        self.assertTrue(m.h[1].weight.requires_grad)
        for name, t in src.state_dict().items():
            self.assertTrue(torch.equal(m.state_dict()[name], t), name)
        self.assertEqual(m.cache.device.type, "cpu")  # not persistent: from the module's own init
        x = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            out = m.lm_head(m.ln_f(m.wte(x) + m.wpe(m.position_ids[:3])))
            want = src.lm_head(src.ln_f(src.wte(x) + src.wpe(src.position_ids[:3])))
        self.assertTrue(torch.equal(out, want))

    def test_load_into_is_zero_copy(self):
        d = self.path("gpt")
        tensorfs.save_state_dict(d, GPT().state_dict())
        m = tensorfs.empty_model(GPT)
        tensorfs.load_into(m, d, mode="r+")
        with torch.no_grad():
            m.h[1].bias[0] = 42.0
        self.assertEqual(tensorfs.open(os.path.join(d, "h.1.bias"), "r")[0], 42.0)  # the segment's own pages
        other = tensorfs.empty_model(GPT)
        tensorfs.load_into(other, d)  # mode "r": copy-on-write
        self.assertEqual(other.h[1].bias[0].item(), 42.0)

    def test_load_into_reports_keys(self):
        src = GPT()
        sd = src.state_dict()
        del sd["lm_head.weight"]  # as transformers saves a tied model
        sd["extra"] = torch.ones(1)
        del sd["ln_f.bias"]
        d = self.path("gpt")
        tensorfs.save_state_dict(d, sd)
        m = GPT(device="meta")
        with self.assertRaises(RuntimeError) as cm:
            tensorfs.load_into(m, d)
        msg = str(cm.exception)
        self.assertIn('Missing key(s) in state_dict: "ln_f.bias"', msg)
        self.assertIn('Unexpected key(s) in state_dict: "extra"', msg)
        m = GPT()  # real: ln_f.bias, which the directory lacks, keeps its own
        keys = tensorfs.load_into(m, d, strict=False)
        self.assertEqual(keys, (["ln_f.bias"], ["extra"]))  # lm_head.weight: tied to wte.weight, loaded
        self.assertIs(m.lm_head.weight, m.wte.weight)
        self.assertTrue(torch.equal(m.lm_head.weight, src.wte.weight))

    def test_load_into_refuses_a_mismatch_and_changes_nothing(self):
        d = self.path("gpt")
        tensorfs.save_state_dict(d, GPT(dim=8).state_dict())
        m = GPT()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with self.assertRaises(RuntimeError) as cm:
            tensorfs.load_into(m, d)
        self.assertIn("size mismatch for wte.weight", str(cm.exception))
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        tensorfs.save_state_dict(self.path("half"), GPT().half().state_dict())
        with self.assertRaises(RuntimeError) as cm:
            tensorfs.load_into(GPT(), self.path("half"))
        self.assertIn("dtype mismatch", str(cm.exception))

    # --- safe_open -------------------------------------------------------------

    def test_safe_open_api(self):
        sd = GPT().state_dict()
        sd["bf"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
        d = self.path("gpt")
        tensorfs.save_state_dict(d, sd, metadata={"format": "pt"})
        out = os.path.join(tempfile.mkdtemp(), "gpt.safetensors")
        tensorfs.export_safetensors(d, out)
        for where in (d, out):
            with tensorfs.safe_open(where, framework="pt") as f:
                keys = f.keys()
                self.assertEqual(keys, sorted(keys))
                self.assertEqual(f.metadata()["format"], "pt")
                for k in keys:
                    self.assertTrue(torch.equal(f.get_tensor(k), sd[k]), (where, k))
                s = f.get_slice("lm_head.weight")  # the name export keeps of the tie
                self.assertEqual(s.get_shape(), [64, 16])
                self.assertEqual(s.get_dtype(), "F32")
                self.assertTrue(torch.equal(s[2:5, ::3], sd["wte.weight"][2:5, ::3]))
                self.assertTrue(torch.equal(f.get_slice("position_ids")[-2:], sd["position_ids"][-2:]))
                self.assertEqual(f.get_tensor("scale").shape, ())
                self.assertEqual(f.get_slice("bf").get_dtype(), "BF16")
                with self.assertRaises(KeyError):
                    f.get_tensor("nope")
            with tensorfs.safe_open(where, framework="np") as f:
                a = f.get_tensor("mask")
                self.assertIsInstance(a, np.ndarray)
                self.assertEqual(a.dtype, np.bool_)
                np.testing.assert_array_equal(a, sd["mask"].numpy())
                np.testing.assert_array_equal(f.get_slice("h.0.weight")[1, :4], sd["h.0.weight"].numpy()[1, :4])
                with self.assertRaises(TypeError):  # numpy has no bfloat16, as for safetensors
                    f.get_tensor("bf")
        with tensorfs.safe_open(d) as f:  # zero-copy: the tensor is on the segment's pages
            t = f.get_tensor("h.0.bias")
        seg = tensorfs.open_torch(os.path.join(d, "h.0.bias"), "r+")
        seg[0] = -3.0
        if self.MODE == "passthrough":  # classic: the mount's mapping is a page-cache copy
            self.assertEqual(t[0].item(), -3.0)

    # --- all or nothing --------------------------------------------------------

    def test_save_replaces_whole(self):
        p = self.path("w")
        tensorfs.save(p, torch.zeros(1024))
        old = tensorfs.open_torch(p, "r")
        tensorfs.save(p, torch.ones(2, 3, dtype=torch.float64))
        self.assertEqual(old.sum().item(), 0)  # a reader keeps the segment it mapped
        self.assertTrue(torch.equal(tensorfs.open_torch(p), torch.ones(2, 3, dtype=torch.float64)))
        self.assertEqual(os.listdir(self.dir), ["w"])
        # Dtype objects as well as names.
        a = tensorfs.open(p, "r", dtype=np.uint8, shape=(48,))
        self.assertEqual(a.dtype, np.uint8)

    def test_errors_say_why(self):
        fd = os.memfd_create("t")
        try:
            os.write(fd, b"\0" * 48)
            for shape, why in (("3x4", "'3x4' in shape '3x4' is not a non-negative integer"),
                               ([3, -4], "-4 in shape")):
                with self.assertRaises(ValueError) as cm:
                    tensorfs.import_fd(fd, self.path("x"), "float32", shape)
                self.assertIn(self.path("x"), str(cm.exception))
                self.assertIn(why, str(cm.exception))
            with self.assertRaises(ValueError) as cm:
                tensorfs.import_fd(fd, self.path("x"), np.float64, (3, 4))
            self.assertIn("needs 96 bytes", str(cm.exception))
        finally:
            os.close(fd)
        sealed = self.path("sealed")
        os.mkdir(sealed)
        os.setxattr(sealed, "user.tensorfs.flags", b"NOCREATE")
        with self.assertRaises(PermissionError) as cm:
            tensorfs.save(os.path.join(sealed, "w"), torch.ones(1))
        self.assertIn("is NOCREATE", str(cm.exception))
        self.assertEqual(cm.exception.filename, os.path.join(sealed, "w"))
        with self.assertRaises(PermissionError) as cm:
            tensorfs.save_state_dict(sealed, {"a": torch.ones(1)})
        self.assertIn("is NOCREATE", str(cm.exception))
        self.assertEqual(os.listdir(sealed), [])

    # --- copy-on-write divergence ------------------------------------------

    def test_copy_on_write_divergence_warns(self):
        from multiprocessing.reduction import ForkingPickler
        d = self.path("m")
        tensorfs.save_state_dict(d, {"x": torch.full((4096,), -1.25)})
        clean = tensorfs.load_state_dict(d)["x"]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ForkingPickler.dumps(clean)
        self.assertEqual(w, [])
        x = tensorfs.load_state_dict(d)["x"]
        x[0] = 7.0
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            back = ForkingPickler.loads(ForkingPickler.dumps(x))
            ForkingPickler.dumps(x)  # once per mapping
        self.assertEqual(len(w), 1, [str(m.message) for m in w])
        self.assertIn("copy-on-write", str(w[0].message))
        self.assertIn("mode='r+'", str(w[0].message))
        self.assertEqual(back[0].item(), -1.25)  # what the other process would see
        shared = tensorfs.load_state_dict(d, mode="r+")["x"]
        shared[1] = 5.0
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertEqual(ForkingPickler.loads(ForkingPickler.dumps(shared))[1].item(), 5.0)
        self.assertEqual(w, [])


class TestModelsPassthrough(_ModelTests, unittest.TestCase):
    MODE = "passthrough"


class TestModelsClassic(_ModelTests, unittest.TestCase):
    MODE = "classic"


class TestFullMount(unittest.TestCase):
    """Saves that do not fit leave nothing behind and say so."""

    @classmethod
    def setUpClass(cls):
        if torch is None:
            unavailable("/usr/bin/python3 has no torch (apt-get install python3-torch)")
        cls.mount = Mount("passthrough", ["--capacity", "24M"])

    @classmethod
    def tearDownClass(cls):
        problems = cls.mount.close()
        if problems:
            raise AssertionError("\n".join(problems))

    def entries(self):
        out = []
        for top, dirs, files in os.walk(self.mount.dir):
            out += [os.path.relpath(os.path.join(top, n), self.mount.dir) for n in dirs + files]
        return sorted(out)

    def test_save_state_dict_full(self):
        mib = 1 << 18  # float32 elements in a MiB
        d = os.path.join(self.mount.dir, "model")
        tensorfs.save_state_dict(d, {"a": torch.zeros(mib), "b": torch.zeros(mib)}, metadata={"v": "1"})
        before = self.entries()
        with self.assertRaises(OSError) as cm:
            tensorfs.save_state_dict(d, {"a": torch.ones(4 * mib), "b": torch.ones(4 * mib),
                                         "c": torch.ones(14 * mib)}, metadata={"v": "2"})
        e = cm.exception
        self.assertEqual(e.errno, errno.ENOSPC)
        self.assertIn("tensor 'c'", str(e))
        self.assertIn("it needs ", str(e))  # what the tensor needed, and what was free
        self.assertIn("and the tensorfs mount %s has " % self.mount.dir, str(e))
        self.assertIn("df -h %s" % self.mount.dir, str(e))
        self.assertEqual(self.entries(), before)  # no partial c, no temporary names
        got = tensorfs.load_state_dict(d)
        self.assertEqual(sorted(got), ["a", "b"])
        self.assertEqual(got["a"].sum().item(), 0)  # the old a, whole
        self.assertEqual(tensorfs.metadata(d), {"v": "1"})
        new = os.path.join(self.mount.dir, "new")
        with self.assertRaises(OSError):
            tensorfs.save_state_dict(new, {"c": torch.ones(30 * mib)})
        self.assertFalse(os.path.exists(new))  # the directory it made is gone too

    def test_save_state_dict_packed_full(self):
        d = os.path.join(self.mount.dir, "packed")
        old = {"s.%d" % i: torch.full((256,), float(i)) for i in range(8)}
        tensorfs.save_state_dict(d, old, pack_below=4096)
        pack = os.path.join(d, "packed.safetensors")
        with open(pack, "rb") as f:
            before, bytes_before = self.entries(), f.read()
        with self.assertRaises(OSError) as cm:  # 30 MiB of small tensors into a 24 MiB mount
            tensorfs.save_state_dict(d, {"t.%d" % i: torch.ones(1 << 16) for i in range(120)}, pack_below=1 << 20)
        e = cm.exception
        self.assertEqual(e.errno, errno.ENOSPC)
        self.assertIn("packing 128 tensors into %s" % pack, str(e))
        self.assertIn("it needs ", str(e))
        self.assertEqual(self.entries(), before)  # no temporary names
        with open(pack, "rb") as f:
            self.assertEqual(f.read(), bytes_before)
        got = tensorfs.load_state_dict(d)
        self.assertEqual(list(got), list(old))
        self.assertTrue(all(torch.equal(got[k], t) for k, t in old.items()))

    def test_save_full(self):
        p = os.path.join(self.mount.dir, "w")
        tensorfs.save(p, torch.arange(4.0))
        with self.assertRaises(OSError) as cm:
            tensorfs.save(p, torch.ones(30 << 18))
        self.assertEqual(cm.exception.errno, errno.ENOSPC)
        self.assertIn(p, str(cm.exception))
        self.assertEqual(self.entries(), ["w"])  # no 0-byte segment, no temporary one
        self.assertTrue(torch.equal(tensorfs.open_torch(p), torch.arange(4.0)))


class TestDeadDaemon(unittest.TestCase):
    def test_dead_daemon_is_reported(self):
        if torch is None:
            unavailable("/usr/bin/python3 has no torch (apt-get install python3-torch)")
        m = Mount("passthrough")
        try:
            d = os.path.join(m.dir, "model")
            tensorfs.save_state_dict(d, {"w": torch.ones(3)})
            m.proc.kill()
            m.proc.wait()
            for call in (lambda: tensorfs.load_state_dict(d), lambda: tensorfs.save(os.path.join(d, "x"), torch.ones(1))):
                with self.assertRaises(OSError) as cm:
                    call()
                self.assertEqual(cm.exception.errno, errno.ENOTCONN)
                self.assertIn("daemon", str(cm.exception))
                self.assertIn("remount", str(cm.exception))
        finally:
            if m.proc.poll() is not None:  # mounting again cleans the stale mount; then purge
                subprocess.run([binary(), "mount", m.dir], capture_output=True, timeout=TIMEOUT)
                subprocess.run([binary(), "unmount", "--purge", m.dir], capture_output=True, timeout=TIMEOUT)
                m.stderr.close()
                m.proc.stdout.close()
            else:
                m.close()


WORKERS = textwrap.dedent("""
    import os, sys, time, torch, tensorfs
    import torch.multiprocessing as mp
    sys.path.insert(0, os.path.dirname(sys.argv[3]))
    from test_models import GPT, pss

    def worker(d, how, ready, done):
        m = tensorfs.empty_model(GPT, vocab=32768, dim=512, layers=4)
        if how == "load_into":
            tensorfs.load_into(m, d)
        elif how == "copy":
            m = GPT(vocab=32768, dim=512, layers=4)
            m.load_state_dict(tensorfs.load_state_dict(d))
        if how != "none":
            for t in m.state_dict().values():  # every page resident and mapped
                float(t.reshape(-1)[::1024].float().sum())
        ready.put(os.getpid())
        done.wait()

    if __name__ == "__main__":
        d, how = sys.argv[1], sys.argv[2]
        ctx = mp.get_context("fork")
        ready, done = ctx.Queue(), ctx.Event()
        start = time.perf_counter()
        procs = [ctx.Process(target=worker, args=(d, how, ready, done)) for _ in range(4)]
        for p in procs:
            p.start()
        pids = [ready.get(timeout=60) for _ in procs]
        print(time.perf_counter() - start, sum(pss(p) for p in pids))
        done.set()
        for p in procs:
            p.join()
    """)


class TestLoadIntoMemory(unittest.TestCase):
    """4 workers load_into one model: one copy of the weights, not four."""

    def test_four_workers_share_one_copy(self):
        if torch is None:
            unavailable("/usr/bin/python3 has no torch (apt-get install python3-torch)")
        m = Mount("passthrough", ["--capacity", "1G"])
        try:
            d = os.path.join(m.dir, "gpt")
            model = GPT(vocab=32768, dim=512, layers=4)
            tensorfs.save_state_dict(d, model.state_dict())
            size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
            script = os.path.join(tempfile.mkdtemp(), "workers.py")
            with open(script, "w") as f:
                f.write(WORKERS)
            got = {}
            for how in ("none", "load_into", "copy"):
                r = subprocess.run([sys.executable, script, d, how, os.path.abspath(__file__)], capture_output=True,
                                   text=True, timeout=TIMEOUT, env=dict(os.environ, PYTHONPATH=PYDIR))
                self.assertEqual(r.returncode, 0, r.stderr)
                secs, mem = r.stdout.split()
                got[how] = (float(secs), int(mem))
            above = {how: got[how][1] - got["none"][1] for how in ("load_into", "copy")}
            print("\n4 workers, %.1f MiB of weights: load_into %.2f s, PSS +%.1f MiB; load_state_dict copy %.2f s, "
                  "PSS +%.1f MiB" % (size / 2**20, got["load_into"][0], above["load_into"] / 2**20,
                                     got["copy"][0], above["copy"] / 2**20), file=sys.stderr)
            self.assertLess(above["load_into"], 1.25 * size)  # one copy, shared
            self.assertGreater(above["copy"], 3 * size)  # four private ones
        finally:
            problems = m.close()
            if problems:
                raise AssertionError("\n".join(problems))


if __name__ == "__main__":
    unittest.main()
