"""load_state_dict's small segments, mapped side by side in one range, against real mounts.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -p test_load_slab.py -v
"""

import gc
import os
import unittest

from test_client import MountedTests, torch

import tensorfs
from tensorfs import _torch as tfs_torch
from tensorfs import statedict


def storage_ptr(t):
    """Address of the storage under t (torch 1.13 and 2.x)."""
    try:
        return t.untyped_storage().data_ptr()
    except AttributeError:
        return t.storage().data_ptr()


def mapped(addr):
    """Whether addr lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class _SlabTests(MountedTests):

    def save(self):
        """A state dict of small segments (sizes not whole pages) and one past the slab's bound."""
        sd = {
            "a": torch.arange(5, dtype=torch.float32),  # 20 bytes
            "b": torch.arange(4097, dtype=torch.int16),  # 8194 bytes: three pages
            "c": torch.tensor([1.5, -2.5, 3.5], dtype=torch.float64),
            "big": torch.arange(statedict._SLAB_MAX // 4 + 1, dtype=torch.float32),
        }
        d = os.path.join(self.dir, "m")
        tensorfs.save_state_dict(d, sd)
        return d, sd

    def test_one_range_shared_both_ways(self):
        d, sd = self.save()
        got = tensorfs.load_state_dict(d, mode="r+")
        for name, t in sd.items():
            self.assertTrue(torch.equal(got[name], t), name)
        small = {storage_ptr(got[n]) for n in ("a", "b", "c")}
        self.assertEqual(len(small), 1, "the small segments are views of one storage")
        self.assertNotIn(storage_ptr(got["big"]), small)
        # A write through the mount shows in the tensor, on a page past the first.
        with open(os.path.join(d, "b"), "r+b") as f:
            os.pwrite(f.fileno(), (-7).to_bytes(2, "little", signed=True), 4096 * 2)
        self.assertEqual(got["b"][4096].item(), -7)
        # A store into the tensor reaches the segment, and only its own.
        got["a"][4] = 99.0
        again = tensorfs.load_state_dict(d)
        self.assertEqual(again["a"].tolist(), [0.0, 1.0, 2.0, 3.0, 99.0])
        self.assertTrue(torch.equal(again["c"], sd["c"]))
        self.assertTrue(torch.equal(again["b"][:4096], sd["b"][:4096]))
        if self.MODE == "passthrough":  # classic: the mount's page cache may hold an older copy
            with open(os.path.join(d, "a"), "rb") as f:
                self.assertEqual(torch.frombuffer(bytearray(f.read()), dtype=torch.float32)[4].item(), 99.0)

    def test_copy_on_write_stays_private(self):
        d, sd = self.save()
        got = tensorfs.load_state_dict(d)
        got["c"][0] = 42.0  # this process's page from here on
        got["a"][0] = 42.0
        again = tensorfs.load_state_dict(d)
        self.assertTrue(torch.equal(again["c"], sd["c"]))
        self.assertTrue(torch.equal(again["a"], sd["a"]))
        with open(os.path.join(d, "b"), "r+b") as f:  # b's pages are untouched here: they follow the segment
            os.pwrite(f.fileno(), (5).to_bytes(2, "little"), 0)
        self.assertEqual(got["b"][0].item(), 5)
        self.assertEqual(got["c"][0].item(), 42.0)

    def test_range_lives_as_long_as_a_tensor_on_it(self):
        d, sd = self.save()
        got = tensorfs.load_state_dict(d)
        base = storage_ptr(got["a"])
        self.assertIn(base, tfs_torch._by_address)
        keep = got["c"][1:]  # a view of a view: it holds the range too
        del got
        gc.collect()
        self.assertTrue(mapped(base))
        self.assertEqual(keep.tolist(), [-2.5, 3.5])
        del keep
        gc.collect()
        self.assertFalse(mapped(base), "the range is unmapped with its last tensor")
        self.assertNotIn(base, tfs_torch._by_address)

    def test_each_slot_pickles_by_its_path(self):
        from multiprocessing.reduction import ForkingPickler
        d, _ = self.save()
        got = tensorfs.load_state_dict(d, mode="r+")
        data = bytes(ForkingPickler.dumps(got["b"][2:6]))
        self.assertIn(os.path.abspath(os.path.join(d, "b")).encode(), data)
        back = ForkingPickler.loads(data)  # mapped again by path
        self.assertEqual(back.tolist(), [2, 3, 4, 5])
        if self.MODE == "passthrough":  # classic: a mapping through the mount is a page-cache copy
            back[0] = -1
            self.assertEqual(got["b"][2].item(), -1)

    def test_hard_links_share_a_slot(self):
        d, _ = self.save()
        os.link(os.path.join(d, "c"), os.path.join(d, "c2"))
        with tensorfs.Client(self.mount.dir) as c:
            links = {}
            for seg, fd in c.load(os.path.relpath(d, self.mount.dir)):
                links[seg["name"]] = seg.get("links")
                os.close(fd)
        self.assertEqual(links, {"a": 1, "b": 1, "c": 2, "c2": 2, "big": 1})
        got = tensorfs.load_state_dict(d, mode="r+")
        self.assertIs(got["c"], got["c2"])  # one inode: one slot, one tensor
        self.assertIsNot(got["a"], got["b"])
        got["c2"][0] = 8.0
        self.assertEqual(tensorfs.load_state_dict(d)["c"][0].item(), 8.0)

    def test_layout_past_its_segment_is_refused(self):
        d, _ = self.save()
        fds = [os.open(os.path.join(d, n), os.O_RDONLY) for n in ("a", "c")]
        try:
            bases, offsets = tfs_torch.map_slab([(fds[0], 20, "a"), (fds[1], 24, "c")], False)
        finally:
            for fd in fds:
                os.close(fd)
        self.assertEqual(offsets, [0, tfs_torch._PAGE])
        fits = tensorfs.TensorMeta("float32", (5,), None, 0, 20)
        self.assertEqual(tfs_torch.view_on(bases, 0, 20, fits, "a").tolist(), [0.0, 1.0, 2.0, 3.0, 4.0])
        for past in (fits._replace(shape=(6,)), fits._replace(storage_offset=1), fits._replace(stride=(2,))):
            with self.assertRaises(ValueError, msg=str(past)):
                tfs_torch.view_on(bases, 0, 20, past, "a")


    def test_failed_mapping_names_the_segment_and_leaves_nothing_mapped(self):
        d, _ = self.save()
        paths = [os.path.join(d, n) for n in ("a", "c")]
        fds = [os.open(paths[0], os.O_RDWR), os.open(paths[1], os.O_RDONLY)]

        def left():
            inodes = {str(os.fstat(fd).st_ino) for fd in fds}
            with open("/proc/self/maps") as f:
                return [line for line in f if line.split()[4] in inodes]
        try:
            bases, _ = tfs_torch.map_slab([(fds[0], 20, paths[0])], True)
            self.assertEqual(len(left()), 1)  # the maps show the segment's inode
            del bases
            gc.collect()
            with self.assertRaises(PermissionError) as cm:  # c's descriptor is read-only: no shared writable map
                tfs_torch.map_slab([(fds[0], 20, paths[0]), (fds[1], 24, paths[1])], True)
            self.assertIn(paths[1], str(cm.exception))
            self.assertEqual(left(), [], "a's mapping is left after c's failed")
        finally:
            for fd in fds:
                os.close(fd)


class TestSlabPassthrough(_SlabTests, unittest.TestCase):
    MODE = "passthrough"


class TestSlabClassic(_SlabTests, unittest.TestCase):
    MODE = "classic"


if __name__ == "__main__":
    unittest.main()
