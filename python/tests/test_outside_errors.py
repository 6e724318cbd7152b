"""Writes outside a mount and errors that say why, against real mounts:
save and save_state_dict refuse a path that is not in a tensorfs mount
unless allow_outside; a save that does not fit says what it needed and
what was free; a value the daemon refuses points at `tensorfs set`.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import errno
import os
import shutil
import subprocess
import tempfile
import unittest

from test_client import MountedTests, binary, torch, unavailable

import tensorfs


class TestOutsideAMount(unittest.TestCase):
    def setUp(self):
        if torch is None:
            unavailable("/usr/bin/python3 has no torch (apt-get install python3-torch)")
        self.dir = tempfile.mkdtemp(prefix="tensorfs-outside-")
        self.addCleanup(shutil.rmtree, self.dir)

    def test_save_refused_unless_allowed(self):
        p = os.path.join(self.dir, "w")
        with self.assertRaises(OSError) as cm:
            tensorfs.save(p, torch.ones(4))
        e = cm.exception
        self.assertEqual(e.errno, errno.ENOENT)
        self.assertEqual(e.filename, p)
        self.assertIn("tensorfs.save: %s is not inside a tensorfs mount" % p, str(e))
        self.assertIn("allow_outside=True", str(e))
        self.assertEqual(os.listdir(self.dir), [])
        tensorfs.save(p, torch.ones(4), allow_outside=True)
        self.assertEqual(os.getxattr(p, "user.tensor.dtype"), b"float32")

    def test_save_state_dict_refused_unless_allowed(self):
        d = os.path.join(self.dir, "model")
        with self.assertRaises(OSError) as cm:
            tensorfs.save_state_dict(d, {"a": torch.ones(2)})
        self.assertIn("is not inside a tensorfs mount", str(cm.exception))
        self.assertFalse(os.path.exists(d))
        tensorfs.save_state_dict(d, {"a": torch.ones(2)}, allow_outside=True)
        self.assertEqual(os.listdir(d), ["a"])


class TestErrorsSayWhy(MountedTests, unittest.TestCase):
    ARGS = ("--capacity", "64M")

    def test_no_room_says_needed_and_free(self):
        p = os.path.join(self.mount.dir, "big")
        with self.assertRaises(OSError) as cm:
            tensorfs.save(p, torch.zeros(25 << 20))  # 100 MiB into an empty 64 MiB mount
        e = cm.exception
        self.assertEqual(e.errno, errno.ENOSPC)
        self.assertIn("it needs 100.0 MiB and the tensorfs mount %s has " % self.mount.dir, str(e))
        self.assertIn(" of 64.0 MiB free: see df -h %s;" % self.mount.dir, str(e))
        self.assertNotIn("big", os.listdir(self.mount.dir))  # nothing of the failed save is left

    def test_refused_value_points_at_tensorfs_set(self):
        p = os.path.join(self.mount.dir, "w")
        tensorfs.save(p, torch.ones(4))
        try:
            os.setxattr(p, "user.tensor.shape", b"[4x4]")
        except OSError as err:
            e = tensorfs._explain(err, p, "setting the shape of %s" % p)
        else:
            self.fail("the daemon took shape [4x4]")
        self.assertEqual(e.errno, errno.EINVAL)
        self.assertIn("`tensorfs set DTYPE SHAPE %s` checks a layout first and says why" % p, str(e))
        r = subprocess.run([binary(), "set", "float32", "[4x4]", p], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn('"4x4" is not a non-negative integer', r.stderr)  # the reason, to whoever asked


if __name__ == "__main__":
    unittest.main()
