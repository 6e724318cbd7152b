#!/usr/bin/env bash
# Installs tensorfs system-wide: the binary in /usr/local/bin and the mount
# helper /sbin/mount.fuse.tensorfs, so "mount -t fuse.tensorfs" and
# /etc/fstab entries of type fuse.tensorfs work.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  exec sudo "$0" "$@"
fi
command -v fusermount3 >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3; }
export PATH="$PATH:/usr/local/go/bin"
go build -o bin/tensorfs ./cmd/tensorfs
install -m 755 bin/tensorfs /usr/local/bin/tensorfs
ln -sf /usr/local/bin/tensorfs /sbin/mount.fuse.tensorfs
echo "installed /usr/local/bin/tensorfs and /sbin/mount.fuse.tensorfs"
