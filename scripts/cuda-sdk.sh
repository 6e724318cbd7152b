#!/usr/bin/env bash
# CUDA headers and the libcuda.so link stub, for building tensorfs's cuda
# backend (gpu/cuda) with -tags cuda on a machine without the CUDA toolkit
# or a GPU:
#
#   eval "$(scripts/cuda-sdk.sh)"
#   go vet -tags cuda ./gpu/...
#   go build -tags cuda -o bin/tensorfs-gpu ./gpu/cmd/tensorfs-gpu
#   go test -c -tags cuda -o bin/gpu-cuda.test ./gpu/cuda/
#
# Downloads Debian's non-free nvidia-cuda-dev package (about 800 MB) with a
# private apt configuration (the system's sources are left alone), unpacks
# cuda.h and the libcuda.so stub from it into the cache directory (1 MB)
# and prints the CGO_CFLAGS and
# CGO_LDFLAGS exports on stdout; progress goes to stderr. A cache that is
# already complete is reused without touching the network.
#
# The cache directory is $TENSORFS_CUDA_SDK, else $HOME/.cache/tensorfs/cuda-sdk.
# Binaries linked this way need libcuda.so.1 from an NVIDIA driver to run.
set -euo pipefail

cache="${TENSORFS_CUDA_SDK:-${HOME:?}/.cache/tensorfs/cuda-sdk}"
root="$cache/root"
apt="$cache/apt"

log() { echo "cuda-sdk: $*" >&2; }

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 # one download at a time per cache

if [ ! -e "$root/.complete" ]; then
	for tool in apt-get dpkg-deb; do
		command -v "$tool" >/dev/null 2>&1 || { log "needs $tool (Debian or Ubuntu)"; exit 1; }
	done
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	[ -n "$codename" ] || { log "no VERSION_CODENAME in /etc/os-release"; exit 1; }
	keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	[ -r "$keyring" ] || { log "no $keyring (apt-get install debian-archive-keyring)"; exit 1; }

	# The Debian archive this machine's apt already uses, with non-free added.
	mirror=$({ awk '/^URIs:/ {print $2}' /etc/apt/sources.list.d/*.sources 2>/dev/null
		awk '$1 == "deb" {print ($2 ~ /^\[/) ? $3 : $2}' /etc/apt/sources.list 2>/dev/null
	} | grep -v -e security -e '^$' | head -n 1) || true # a missing file or an early head is fine
	[ -n "$mirror" ] || { log "no Debian archive in this machine's apt sources"; exit 1; }

	rm -rf "$apt" "$root"
	mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/download" "$root"
	cat >"$apt/sources.list" <<-EOF
		deb [signed-by=$keyring] $mirror $codename main contrib non-free
		deb [signed-by=$keyring] $mirror $codename-updates main contrib non-free
	EOF
	aptopts=(
		-q
		-o "Dir::Etc::SourceList=$apt/sources.list"
		-o "Dir::Etc::SourceParts=/dev/null"
		-o "Dir::State::Lists=$apt/lists"
		-o "Dir::Cache=$apt/cache"
		-o "APT::Sandbox::User=$(id -un)"
	)
	log "apt-get update (private lists with non-free, in $apt)"
	apt-get "${aptopts[@]}" update >&2
	log "apt-get download nvidia-cuda-dev"
	(cd "$apt/download" && apt-get "${aptopts[@]}" download nvidia-cuda-dev >&2)
	deb=$(find "$apt/download" -name 'nvidia-cuda-dev_*.deb' | head -n 1)
	[ -n "$deb" ] || { log "apt-get download left no nvidia-cuda-dev .deb"; exit 1; }
	# The build needs cuda.h and the stub alone: the other 2.7 GB of the
	# package are not written (decompressing it is most of the time).
	log "cuda.h and stubs/libcuda.so from $(basename "$deb") into $root"
	members=('./usr/include/cuda.h' './usr/lib/*/stubs/libcuda.so')
	# Two blocks of its 2.7 GiB of tar (scripts/deb-extract.py) rather than
	# all of them: 45 CPU-seconds saved; the usual way when it cannot.
	rc=0
	if command -v python3 >/dev/null 2>&1; then
		python3 "$(dirname "$0")/deb-extract.py" "$deb" "$root" "${members[@]}" || rc=$?
	else
		rc=3
	fi
	if [ "$rc" -eq 3 ]; then
		dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$root" --wildcards "${members[@]}"
	elif [ "$rc" -ne 0 ]; then
		exit "$rc"
	fi
	rm -rf "$apt" # the .deb and lists; the unpacked tree is the cache
	touch "$root/.complete"
fi

header="$root/usr/include/cuda.h"
stub=$(find "$root/usr/lib" -path '*/stubs/libcuda.so' | head -n 1)
[ -r "$header" ] || { log "$header missing; remove $cache and run again"; exit 1; }
[ -n "$stub" ] || { log "no stubs/libcuda.so under $root/usr/lib; remove $cache and run again"; exit 1; }
log "cuda.h and libcuda.so stub in $root"
printf 'export CGO_CFLAGS=%q\n' "-O2 -g -I$root/usr/include"
printf 'export CGO_LDFLAGS=%q\n' "-O2 -g -L$(dirname "$stub")"
