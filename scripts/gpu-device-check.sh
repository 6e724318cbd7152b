#!/usr/bin/env bash
# GPU segments on a real GPU, with binaries built elsewhere (no Go needed
# here): a cuda:0 segment's bytes through cp, a second process's view of
# its IPC handle (CuPy), and both across tensorfs restart, a SIGKILL of
# the daemon, and an unmount and remount (DESIGN.md §6, §12).
#
#   scripts/gpu-device-check.sh BINDIR
#
# BINDIR (root's, writable by no one else: the daemon runs tensorfs-gpu
# only then) holds what was built on a machine with Go, at the repository's
# root:
#
#   eval "$(scripts/cuda-sdk.sh)"
#   go build -o BINDIR/tensorfs ./cmd/tensorfs
#   go build -tags cuda -o BINDIR/tensorfs-gpu ./gpu/cmd/tensorfs-gpu
#   go test -c -o BINDIR/gpu.test ./gpu/                  # optional
#   go test -c -o BINDIR/integration.test ./integration/  # optional
#
# Run it as root from the repository's root (the integration tests find
# it by its go.mod). It prints one PASS, FAIL or SKIP line per check and
# exits 1 if any failed. Without /dev/fuse it says so and runs only what
# does not mount (gpu.test against tensorfs-gpu). GPU_CHECK_BACKEND=sim
# runs the same logic on the simulated device (no GPU, no CuPy: the
# consumer maps the sim's allocation through its IPC stand-in), to check
# the script itself. It takes under four minutes.
set -u

bin=${1:?usage: $0 BINDIR}
bin=$(cd "$bin" && pwd)
backend=${GPU_CHECK_BACKEND:-cuda}
failures=0
pass() { echo "PASS $*"; }
fail() {
	echo "FAIL $*"
	failures=$((failures + 1))
}
skip() { echo "SKIP $*"; }

work=$(mktemp -d /tmp/gpu-device-check.XXXXXX)
mp=$work/mnt
mounted=no
cleanup() {
	[ -n "${CONS_PID:-}" ] && kill "$CONS_PID" 2>/dev/null
	if [ "$mounted" = yes ]; then
		timeout 30 "$bin/tensorfs" unmount --purge "$mp" >/dev/null 2>&1 || umount -l "$mp" 2>/dev/null
	fi
	rm -rf "$work"
}
trap cleanup EXIT

# 1. The helper outlives a daemon's session, without FUSE: a second
# session claims the first's blocks with their bytes, tags and IPC handle.
if [ -x "$bin/gpu.test" ]; then
	env=()
	[ "$backend" = cuda ] && env=(TENSORFS_TEST_GPU_HELPER="$bin/tensorfs-gpu")
	if out=$(cd "$work" && env "${env[@]}" timeout 60 "$bin/gpu.test" -test.run '^TestHelperOutlivesSession$' -test.count=1 2>&1); then
		pass "helper: a successor's session claims the blocks, bytes and IPC handle of a dead daemon's ($backend)"
	else
		fail "helper: a successor's session does not claim the blocks ($backend): $(echo "$out" | tail -5)"
	fi
else
	skip "helper test: no $bin/gpu.test"
fi

if [ ! -c /dev/fuse ]; then
	skip "every check that mounts: /dev/fuse is missing on this machine"
	echo "checks failed: $failures"
	[ "$failures" = 0 ]
	exit
fi

# py runs a Python snippet with arguments (no attr tools needed).
py() { python3 -c "$@"; }
stat_of() { py 'import json,os,sys; s=json.loads(os.getxattr(sys.argv[1],"user.tensorfs.stats")); print(eval(sys.argv[2]))' "$mp" "$1"; }

# The consumer: opens the segment's IPC handle (CuPy, or the sim's
# stand-in), counts itself in its counter, and answers "check" (its view
# and the handle the segment shows now against the file's bytes) and
# "write OFF HEX" (into device memory) on stdin.
consumer=$(
	cat <<'EOF'
import hashlib, mmap, os, struct, sys
seg, n, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
h0 = os.getxattr(seg, "user.tensorfs.cuda.ipc_handle")
path, _ = os.getxattr(seg, "user.tensorfs.cuda.ref_counter").decode().rsplit(":", 1)
cell = mmap.mmap(os.open(path, os.O_RDWR), 8)
def add(k):
    cell[:8] = struct.pack("<q", struct.unpack("<q", cell[:8])[0] + k)
if backend == "cuda":
    import ctypes, cupy
    rt = cupy.cuda.runtime
    ptr = rt.ipcOpenMemHandle(h0)
    def view():
        out = ctypes.create_string_buffer(n)
        rt.memcpy(ctypes.addressof(out), ptr, n, rt.memcpyDeviceToHost)
        return out.raw
    def write(off, b):
        src = ctypes.create_string_buffer(b, len(b))
        rt.memcpy(ptr + off, ctypes.addressof(src), len(b), rt.memcpyHostToDevice)
else:
    size, pid, fd = struct.unpack("<qii", h0[24:40])
    mem = mmap.mmap(os.open("/proc/%d/fd/%d" % (pid, fd), os.O_RDWR), size)
    def view():
        return mem[:n]
    def write(off, b):
        mem[off:off + len(b)] = b
def filebytes():
    fd = os.open(seg, os.O_RDONLY)
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)
add(1)
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "check":
        v, f, h = view(), filebytes(), os.getxattr(seg, "user.tensorfs.cuda.ipc_handle")
        why = [w for w, bad in (("its view differs from the file", v != f), ("the IPC handle changed", h != h0)) if bad]
        print("ok" if not why else "bad " + "; ".join(why), hashlib.sha256(f).hexdigest(), flush=True)
    elif cmd == "write":
        write(int(args[0]), bytes.fromhex(args[1]))
        print("ok", flush=True)
    elif cmd == "quit":
        add(-1)
        print("ok", flush=True)
        break
EOF
)

ask() { # ask CMD: the consumer's answer, or "no answer"
	echo "$1" >&"${CONS[1]}"
	local line
	if read -r -t 60 line <&"${CONS[0]}"; then echo "$line"; else echo "no answer"; fi
}

# 2. Mount with the GPU, cp a host file into a cuda:0 segment and back.
mkdir -p "$mp"
n=$((9 * 1024 * 1024 + 123))
head -c $n /dev/urandom >"$work/src"
if out=$(timeout 60 "$bin/tensorfs" mount --gpu "$backend" --capacity 1G "$mp" 2>&1); then
	mounted=yes
	backend_on=$(stat_of 's["gpu"]["backend"]' 2>/dev/null)
	if [ "$backend_on" = "$backend" ]; then pass "mount --gpu $backend: GPU segments on"; else fail "mount --gpu $backend: stats say backend '$backend_on': $out"; fi
else
	fail "mount --gpu $backend: $out"
	echo "checks failed: $failures"
	exit 1
fi
log=$(echo "$out" | sed -n 's/.*; log \(.*\))$/\1/p')
seg=$mp/gpu/w
mkdir "$mp/gpu" && py 'import os,sys; os.setxattr(sys.argv[1], "user.tensorfs.device", b"cuda:0")' "$mp/gpu"
cp "$work/src" "$seg" && cp "$seg" "$work/back"
dev=$(py 'import os,sys; print(os.getxattr(sys.argv[1], "user.tensorfs.device").decode())' "$seg")
if [ "$dev" = cuda:0 ] && cmp -s "$work/src" "$work/back"; then
	pass "cp of a host file into a cuda:0 segment and back: bytes equal"
else
	fail "cp into a cuda:0 segment and back: device '$dev', bytes $(cmp "$work/src" "$work/back" 2>&1 || true)"
fi

# 3. A second process opens the IPC handle: bytes equal; its write shows
# in the file.
coproc CONS { exec python3 -u -c "$consumer" "$seg" "$n" "$backend" 2>"$work/consumer.err"; }
CONS_PID=$!
via=CuPy
[ "$backend" = sim ] && via="the sim's IPC stand-in"
if read -r -t 60 line <&"${CONS[0]}" && [ "$line" = ready ]; then
	pass "a second process opened the IPC handle ($via) and counts itself in the counter"
else
	fail "the consumer did not start: $(tail -3 "$work/consumer.err")"
fi
check() { # check WHAT: the consumer's view, the file and the handle agree
	local ans
	ans=$(ask check)
	case "$ans" in
	ok*) pass "$1: the consumer's view equals the file, its IPC handle unchanged" ;;
	*) fail "$1: $ans $(tail -3 "$work/consumer.err")" ;;
	esac
}
check "after cp"
printf '\xde\xad\xbe\xef' | dd of="$work/src" bs=1 seek=4096 conv=notrunc status=none
ask "write 4096 deadbeef" >/dev/null
if cmp -s "$work/src" "$seg"; then pass "a write by the consumer into device memory shows in the file"; else fail "the consumer's write does not show in the file"; fi

# 4. tensorfs restart and a SIGKILL of the daemon, the consumer mapped.
if out=$(timeout 60 "$bin/tensorfs" restart "$mp" 2>&1); then pass "tensorfs restart: $out"; else fail "tensorfs restart: $out"; fi
if cmp -s "$work/src" "$seg"; then pass "after tensorfs restart: the file's bytes are equal"; else fail "after tensorfs restart: the file's bytes differ"; fi
check "after tensorfs restart"
old=$(stat_of 's["daemon"]["pid"]')
kill -9 "$old"
for _ in $(seq 100); do
	pid=$(stat_of 's["daemon"]["pid"]' 2>/dev/null)
	[ -n "$pid" ] && [ "$pid" != "$old" ] && break
	sleep 0.1
done
if [ -n "$pid" ] && [ "$pid" != "$old" ]; then pass "SIGKILL of the daemon $old: daemon $pid serves the mount"; else fail "SIGKILL of the daemon $old: no new daemon"; fi
if cmp -s "$work/src" "$seg"; then pass "after the SIGKILL: the file's bytes are equal"; else fail "after the SIGKILL: the file's bytes differ ($(grep -c 'reads as zeros' "$log" 2>/dev/null) segments lost)"; fi
check "after the SIGKILL"
ask quit >/dev/null
wait "$CONS_PID" 2>/dev/null
CONS_PID=

# 5. Unmount spills, a new mount restores.
if out=$(timeout 60 "$bin/tensorfs" unmount "$mp" 2>&1); then
	mounted=no
	if out=$(timeout 60 "$bin/tensorfs" mount --gpu "$backend" --capacity 1G "$mp" 2>&1); then
		mounted=yes
		if cmp -s "$work/src" "$seg"; then pass "unmount spilled, mount restored: bytes equal"; else fail "after unmount and mount: bytes differ"; fi
	else
		fail "mount again: $out"
	fi
else
	fail "unmount: $out"
fi

# 6. The integration tests' GPU checks against this backend (they need
# setfattr and getfattr, package attr).
if [ -x "$bin/integration.test" ] && command -v setfattr >/dev/null; then
	if out=$(TENSORFS_BIN="$bin/tensorfs" TENSORFS_TEST_GPU="$backend" TENSORFS_STRICT=1 timeout 150 "$bin/integration.test" -test.run '^TestGPU(ReadWrite|WriteGrowth|Truncate|CopyFileRange|SpillRestore|LimboRefCounter)$' -test.count=1 2>&1); then
		pass "integration tests (TestGPU ReadWrite, WriteGrowth, Truncate, CopyFileRange, SpillRestore, LimboRefCounter) with --gpu $backend"
	else
		fail "integration tests with --gpu $backend: $(echo "$out" | grep -E -- '--- FAIL|_test.go' | head -10)"
	fi
else
	skip "integration tests: no $bin/integration.test, or no setfattr (apt-get install attr)"
fi

echo "checks failed: $failures"
[ "$failures" = 0 ]
