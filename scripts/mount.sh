#!/usr/bin/env bash
# From a fresh machine to a ready mount:
#   sudo ./scripts/mount.sh [MOUNTPOINT] [tensorfs mount flags...]
# MOUNTPOINT defaults to /mnt/tensorfs; flags such as --capacity 8G follow it.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
	if command -v sudo >/dev/null 2>&1; then
		exec sudo -E env "PATH=$PATH" bash "$0" "$@"
	fi
	echo "mount.sh: mounting needs root (no sudo here)" >&2
	exit 1
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
if [ "${#need[@]}" -gt 0 ]; then
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
