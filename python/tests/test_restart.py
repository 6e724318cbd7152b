"""Control-socket clients across a daemon's restart and crash, against real mounts.

A restarted daemon (tensorfs restart, or its keeper after a SIGKILL) ends
its control connections; a client sends its request again to the new one.

Run: cd python && PYTHONPATH=$PWD /usr/bin/python3 -m unittest discover -s tests -p test_restart.py -v
"""

import os
import signal
import subprocess
import threading
import time
import unittest

from test_client import TIMEOUT, MountedTests, binary, torch

import tensorfs


def daemon_pid(mount):
    """The pid of the daemon that serves mount now (its pid file)."""
    with open(tensorfs.socket_path(mount)[:-len(".sock")] + ".pid") as f:
        return int(f.read().strip())


def restart(mount):
    subprocess.run([binary(), "restart", mount], check=True, capture_output=True, timeout=TIMEOUT)


def crash(mount):
    """SIGKILL the daemon and wait until its keeper's successor serves."""
    old = daemon_pid(mount)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if daemon_pid(mount) != old:
                os.getxattr(mount, "user.tensorfs.stats")
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError("no new daemon serves %s 20 s after a SIGKILL" % mount)


class TestRestart(MountedTests, unittest.TestCase):
    """The control socket does not depend on the mode: passthrough only."""

    NEEDS = ("torch",)

    def test_client_outlives_restart_and_crash(self):
        with open(os.path.join(self.dir, "w"), "wb") as f:
            f.write(b"weights!")
        rel = os.path.relpath(self.dir, self.mount.dir)

        def load(c):
            (seg, fd), = list(c.load(rel))
            try:
                return seg["name"], os.pread(fd, 8, 0)
            finally:
                os.close(fd)

        with tensorfs.Client(self.mount.dir, timeout=TIMEOUT) as c:
            for event in (restart, crash, restart):
                self.assertEqual(load(c), ("w", b"weights!"))
                event(self.mount.dir)
                # The same client, whose connection the daemon ended.
                self.assertEqual(load(c), ("w", b"weights!"), "after " + event.__name__)

    def test_loads_during_restarts(self):
        sd = {"layer%d.weight" % i: torch.full((64,), float(i)) for i in range(100)}
        tensorfs.save_state_dict(os.path.join(self.dir, "m"), sd)
        errors, loads = [], [0]
        stop = threading.Event()

        def load():
            while not stop.is_set():
                try:
                    got = tensorfs.load_state_dict(os.path.join(self.dir, "m"))
                    if len(got) != len(sd) or not all(torch.equal(got[k], v) for k, v in sd.items()):
                        errors.append("a load differs")
                    loads[0] += 1
                except Exception as e:  # every error counts
                    errors.append(repr(e))

        t = threading.Thread(target=load)
        t.start()
        try:
            for _ in range(2):
                time.sleep(0.2)
                restart(self.mount.dir)
                time.sleep(0.2)
                crash(self.mount.dir)
            time.sleep(0.2)
        finally:
            stop.set()
            t.join()
        self.assertEqual(errors, [])
        self.assertGreater(loads[0], 4)


if __name__ == "__main__":
    unittest.main()
