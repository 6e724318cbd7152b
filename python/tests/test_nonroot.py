"""A mount by a user who is not root (classic mode), used from Python.

fusermount3 (setuid root) opens /dev/fuse with the caller's rights, and
this machine's /dev/fuse is mode 0600, so no other uid can mount here as
it is. The test runs in a private mount namespace (unshare -m) in which a
fresh 0666 node of the same device (10, 229, the usual mode) is bound over
/dev/fuse; nothing outside the namespace changes. The unprivileged uid then
mounts with fusermount3 as any user would.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -v
"""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap
import unittest

from test_client import PYDIR, binary, np, torch, unavailable

USER = "nobody"  # fusermount3 wants the uid to have a name

SCRIPT = textwrap.dedent("""
    import errno, os, subprocess, sys
    import numpy as np, torch, tensorfs
    bin, mnt = sys.argv[1:3]
    r = subprocess.run([bin, "mount", "--capacity", "64M", mnt], capture_output=True, text=True)
    print("capacity", r.returncode, "root" in r.stderr and "/dev/shm" in r.stderr)
    r = subprocess.run([bin, "mount", mnt], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    print("mounted", "mode=classic" in r.stdout + r.stderr)
    try:
        x = torch.arange(12, dtype=torch.float32)
        tensorfs.publish(x, mnt + "/pub")
        print("publish", oct(os.stat(mnt + "/pub").st_mode & 0o777), tensorfs.open(mnt + "/pub")[:3].tolist())
        fd = os.memfd_create("m")
        os.write(fd, np.arange(4, dtype=np.int32).tobytes())
        tensorfs.import_fd(fd, mnt + "/imp", "int32", [2, 2])
        print("import_fd", tensorfs.open(mnt + "/imp").tolist())
        tensorfs.save_state_dict(mnt + "/m", {"a.w": torch.ones(3)})
        sd = tensorfs.load_state_dict(mnt + "/m")
        print("state dict", sd["a.w"].tolist())
    finally:
        r = subprocess.run([bin, "unmount", "--purge", mnt], capture_output=True, text=True)
        print("unmounted", r.returncode, r.stderr.strip())
    """)

WANT = """capacity 2 True
mounted True
publish 0o444 [0.0, 1.0, 2.0]
import_fd [[0, 1], [2, 3]]
state dict [1.0, 1.0, 1.0]
unmounted 0 """


class TestNonRoot(unittest.TestCase):
    def test_user_mount_publish_import_load(self):
        if os.geteuid() != 0:
            unavailable("the non-root test sets up its namespace as root (uid %d)" % os.geteuid())
        if np is None or torch is None:
            unavailable("/usr/bin/python3 needs numpy and torch")
        for tool in ("unshare", "setpriv", "mknod", "fusermount3"):
            if not shutil.which(tool):
                unavailable("no %s (util-linux, coreutils, fuse3)" % tool)
        try:
            uid = pwd.getpwnam(USER).pw_uid
        except KeyError:
            unavailable("no user %r in /etc/passwd" % USER)
        exe = binary()
        for d in (PYDIR, os.path.dirname(exe)):  # the user must reach both
            if os.stat(d).st_mode & 0o005 != 0o005:
                unavailable("%s is not readable by other users" % d)
        tmp = tempfile.mkdtemp(prefix="tensorfs-nonroot-")
        mnt = os.path.join(tmp, "mnt")
        try:
            os.chmod(tmp, 0o755)
            os.mkdir(mnt)
            os.chown(mnt, uid, uid)
            dev = os.path.join(tmp, "dev")
            os.mkdir(dev)
            # The namespace starts with a copy of every mount, other tests' FUSE mounts too, and
            # while it holds one, unmounting that outside does not end its daemon's connection
            # (their teardown waited on it): drop those copies first, here only.
            setup = ("awk '{{split($0, a, \" - \"); split(a[2], b, \" \"); if (b[1] ~ /^fuse/) print $5}}' "
                     "/proc/self/mountinfo | while read -r m; do umount -l \"$m\" 2>/dev/null || true; done; "
                     "set -e; mount -t tmpfs -o mode=755 tmpfs {dev}; mknod -m 666 {dev}/fuse c 10 229; "
                     "mount --bind {dev}/fuse /dev/fuse; "
                     "exec setpriv --reuid={uid} --regid={uid} --clear-groups --reset-env "
                     "env PYTHONPATH={py} /usr/bin/python3 -c \"$0\" {bin} {mnt}").format(
                         dev=dev, uid=uid, py=PYDIR, bin=exe, mnt=mnt)
            r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", setup, SCRIPT],
                               capture_output=True, text=True, timeout=120, cwd=tmp)
            if r.returncode != 0 and "unshare failed" in r.stderr:
                unavailable("no private mount namespace here: " + r.stderr)
            self.assertEqual(r.stdout.strip(), WANT.strip(), r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            # The daemon's log in the user's state directory (README "Non-root").
            for log in glob.glob("/dev/shm/tensorfs-%d/%s-*.log" % (uid, mnt.strip("/").replace("/", "-"))):
                os.unlink(log)


if __name__ == "__main__":
    unittest.main()
