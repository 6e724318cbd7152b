#!/usr/bin/env bash
# From a fresh machine to a ready mount:
#   ./scripts/mount.sh [MOUNTPOINT] [tensorfs mount flags...]
# MOUNTPOINT defaults to /mnt/tensorfs; flags such as --capacity 8G follow it.
#
# As root (or through sudo, when sudo works without a password and
# MOUNT_AS_USER is not set) it installs fuse3 and attr if missing and mounts
# in passthrough mode with a private tmpfs. As any other user it mounts for
# that user alone, in classic mode (README "Non-root"): segments live in
# /dev/shm under its limit (--capacity is refused), reads and writes go
# through the daemon, and nothing is installed. That needs fusermount3
# (Debian's fuse3), read-write access to /dev/fuse and a Go toolchain;
# this script says which is missing.
set -euo pipefail

if [ "$(id -u)" -ne 0 ] && [ -z "${MOUNT_AS_USER:-}" ] && command -v sudo >/dev/null 2>&1 &&
	sudo -n true 2>/dev/null; then
	exec sudo -E env "PATH=$PATH" bash "$0" "$@"
fi
if [ "$(id -u)" -ne 0 ]; then
	why=()
	command -v fusermount3 >/dev/null 2>&1 ||
		why+=("fusermount3 is not installed (root: apt-get install fuse3)")
	if [ ! -r /dev/fuse ] || [ ! -w /dev/fuse ]; then
		why+=("/dev/fuse is $(stat -c '%A %U' /dev/fuse 2>/dev/null || echo missing): uid $(id -u) cannot open it (root: chmod 0666 /dev/fuse, its usual mode)")
	fi
	command -v getfattr >/dev/null 2>&1 ||
		echo "mount.sh: note: getfattr is not installed (root: apt-get install attr); the mount works without it" >&2
	if [ "${#why[@]}" -gt 0 ]; then
		echo "mount.sh: uid $(id -u) cannot mount FUSE here:" >&2
		printf '  - %s\n' "${why[@]}" >&2
		echo "  Run it as root (or with sudo) for a passthrough mount with --capacity." >&2
		exit 1
	fi
	echo "mount.sh: mounting as uid $(id -u), not root: classic mode (reads and writes through the daemon)," >&2
	echo "  segments in /dev/shm under its limit, no --capacity, no --allow-other unless /etc/fuse.conf has user_allow_other" >&2
fi

cd "$(dirname "$0")/.."
repo=$PWD

mp=/mnt/tensorfs
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
	mp=$1
	shift
fi

need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v getfattr >/dev/null 2>&1 || need+=(attr)
if [ "${#need[@]}" -gt 0 ] && [ "$(id -u)" -eq 0 ]; then
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
	export PATH="$PATH:/usr/local/go/bin"
fi
if ! command -v go >/dev/null 2>&1; then
	echo "mount.sh: no go toolchain on PATH; install Go $(sed -n 's/^go //p' go.mod) to /usr/local/go" >&2
	exit 1
fi

go build -o bin/tensorfs ./cmd/tensorfs
mkdir -p "$mp"
mp=$(cd "$mp" && pwd -P)
# Flags go before the mountpoint.
bin/tensorfs mount "$@" "$mp"

cat <<MSG
tensorfs is mounted at $mp. Try:
  dd if=/dev/urandom of=$mp/w bs=1M count=16
  getfattr -d -m - $mp/w                              # a segment's attributes
  getfattr -n user.tensorfs.stats --only-values $mp   # mount statistics
Unmount (and release its memory):
  $repo/bin/tensorfs unmount --purge $mp
MSG
