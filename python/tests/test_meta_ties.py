"""Meta-built models and ties across the Hugging Face boundary, against a real mount:
load_into leaves nothing on the meta device (empty_model gives buffers real
storage, or load_into refuses naming each tensor), load_state_dict returns
the tied names a checkpoint dropped, and export leaves out the names listed
as tied, as save_pretrained writes its files.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

from test_client import MountedTests, binary, torch

import tensorfs

if torch is not None:
    class HFStyle(torch.nn.Module):
        """GPT-2's shape in small: lm_head tied to wte, a causal mask registered persistent=False."""

        def __init__(self, vocab=64, dim=16, ctx=8, device=None):
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, dim, device=device)
            self.wpe = torch.nn.Embedding(ctx, dim, device=device)
            self.proj = torch.nn.Linear(dim, dim, device=device)
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False, device=device)
            self.lm_head.weight = self.wte.weight
            self.register_buffer("bias", torch.ones(ctx, ctx, dtype=torch.bool, device=device).tril(),
                                 persistent=False)

        def forward(self, ids):
            n = ids.shape[-1]
            x = self.wte(ids) + self.wpe(torch.arange(n))
            x = self.proj(self.bias[:n, :n].float() @ x)  # fails on meta: "Cannot inplace into non-meta..."
            return self.lm_head(x)


class TestMetaAndTies(MountedTests, unittest.TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)
        self.src = HFStyle()
        self.model = os.path.join(self.dir, "model")
        tensorfs.save_state_dict(self.model, self.src.state_dict())

    # --- meta ----------------------------------------------------------------

    def test_meta_buffer_refused_and_nothing_changed(self):
        m = HFStyle(device="meta")
        with self.assertRaises(RuntimeError) as cm:
            tensorfs.load_into(m, self.model)
        msg = str(cm.exception)
        self.assertIn("would stay on the meta device", msg)
        self.assertIn("bias: a non-persistent buffer, which no checkpoint holds", msg)
        self.assertIn("tensorfs.empty_model(HFStyle, ...)", msg)
        self.assertEqual(m.wte.weight.device.type, "meta")  # nothing replaced
        self.assertEqual(m.bias.device.type, "meta")

    def test_meta_parameter_left_out_refused(self):
        sd = self.src.state_dict()
        del sd["proj.bias"]
        d = os.path.join(self.dir, "partial")
        tensorfs.save_state_dict(d, sd)
        m = tensorfs.empty_model(HFStyle)
        with self.assertRaises(RuntimeError) as cm:
            tensorfs.load_into(m, d, strict=False)
        self.assertIn("proj.bias: not in %s" % d, str(cm.exception))
        self.assertEqual(m.proj.weight.device.type, "meta")

    def test_empty_model_loads_and_runs(self):
        m = tensorfs.empty_model(HFStyle)
        self.assertEqual(m.wte.weight.device.type, "meta")
        self.assertEqual(m.bias.device.type, "cpu")  # from the module's own init
        self.assertIs(m.lm_head.weight, m.wte.weight)
        self.assertEqual(tensorfs.load_into(m, self.model), tensorfs.IncompatibleKeys([], []))
        left = [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.device.type == "meta"]
        self.assertEqual(left, [])
        self.assertIs(m.lm_head.weight, m.wte.weight)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            self.assertTrue(torch.equal(m(ids), self.src(ids)))
        self.assertIs(torch.nn.Module.register_parameter, torch.nn.Module.__dict__["register_parameter"])

    # --- ties ----------------------------------------------------------------

    def pretrained(self):
        """A checkpoint as save_pretrained writes it: no lm_head.weight."""
        sd = {k: v for k, v in self.src.state_dict().items() if k != "lm_head.weight"}
        d = os.path.join(self.dir, "pretrained")
        tensorfs.save_state_dict(d, sd, metadata={"format": "pt"})
        return d

    def test_load_state_dict_returns_dropped_ties(self):
        d = self.pretrained()
        m = HFStyle()
        with self.assertRaises(RuntimeError) as cm:
            m.load_state_dict(tensorfs.load_state_dict(d))
        self.assertIn("lm_head.weight", str(cm.exception))
        for tied in (m, {"lm_head.weight": "wte.weight"}, [("wte.weight", "lm_head.weight")]):
            sd = tensorfs.load_state_dict(d, tied=tied)
            self.assertIs(sd["lm_head.weight"], sd["wte.weight"], tied)
        m.load_state_dict(tensorfs.load_state_dict(d, tied=m))
        self.assertTrue(torch.equal(m.lm_head.weight, self.src.wte.weight))
        with self.assertRaises(TypeError):
            tensorfs.load_state_dict(d, tied=["lm_head.weight"])

    def test_export_tied_matches_save_pretrained(self):
        full = os.path.join(self.dir, "full")
        tensorfs.save_state_dict(full, self.src.state_dict(), metadata={"format": "pt"})  # one segment, two names
        want = os.path.join(self.dir, "want.safetensors")
        tensorfs.export_safetensors(self.pretrained(), want)
        got = os.path.join(self.dir, "got.safetensors")
        tensorfs.export_safetensors(full, got, tied=["lm_head.weight"])
        with open(want, "rb") as a, open(got, "rb") as b:
            self.assertEqual(a.read(), b.read())
        default = os.path.join(self.dir, "default.safetensors")
        tensorfs.export_safetensors(full, default)  # the first name in byte order, the other an entry
        with tensorfs.safe_open(default, framework="pt") as f:
            self.assertIn("lm_head.weight", f.keys())
            self.assertNotIn("wte.weight", f.keys())
            self.assertEqual(f.metadata()["wte.weight"], "lm_head.weight")
        for bad in (["proj.weight"], ["nope"], ["lm_head.weight", "wte.weight"]):
            with self.assertRaises(ValueError):
                tensorfs.export_safetensors(full, got, tied=bad)

        # The CLI, sharded: the index has wte.weight and neither lm_head.weight nor an entry for it.
        out = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, out)
        r = subprocess.run([binary(), "export", "--tied", "lm_head.weight", "--max-shard-size", "5000", full, out + "/"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.assertIn("wte.weight", index["weight_map"])
        self.assertNotIn("lm_head.weight", index["weight_map"])
        self.assertEqual(set(index["metadata"]), {"total_size"})
        back = os.path.join(self.dir, "back")
        r = subprocess.run([binary(), "import", out, back], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        m = tensorfs.empty_model(HFStyle)
        sd = tensorfs.load_state_dict(back, tied=m)
        self.assertIs(sd["lm_head.weight"], sd["wte.weight"])
        tensorfs.load_into(m, back)
        self.assertIs(m.lm_head.weight, m.wte.weight)


if __name__ == "__main__":
    unittest.main()
