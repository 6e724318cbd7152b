#!/usr/bin/env bash
# A tensorfs cluster on one machine, for tests, benchmarks and the README
# walk-through (run as root).
#
#   scripts/cluster.sh up N DIR [--rate RATE] [--capacity SIZE]
#                                               build it: etcd and N nodes,
#                                               node K's tensorfs at DIR/nodeK
#   scripts/cluster.sh down DIR                 remove everything up made
#   scripts/cluster.sh exec DIR NAME CMD...     run CMD in NAME's network
#                                               namespace (node1..nodeN, etcd)
#   scripts/cluster.sh mount DIR K [FLAGS...]   mount node K again (after its
#                                               daemon died or was unmounted),
#                                               FLAGS added to tensorfs mount's
#   scripts/cluster.sh etcd DIR stop|start      stop or start etcd
#
# Layout. Every node and etcd get a network namespace of their own; their
# links (veth pairs) meet at a bridge in one more namespace (the switch),
# so nothing of the test bed is in the host's network namespace and no
# traffic leaves the namespaces made here. nodeK is 10.99.0.K/24, etcd
# 10.99.0.254. Each node's link is shaped with tc (tbf) to RATE in each
# direction (default 1gbit; tc's units: 10gbit, 500mbit, ...); etcd's is
# not. Namespaces are named tfs-ID-NAME, ID derived from DIR, so test beds
# in different directories coexist.
#
# DIR receives: certs/ (a cluster CA made with openssl and a certificate
# per node and for etcd, each naming its node and address), etcd/ (data),
# etcd.log, bin/tensorfs (built from this checkout, or $TENSORFS_BIN if
# set), bin/tensorfs-testbed ($TENSORFS_TESTBED_BIN if set: it runs
# etcd, Debian's etcd-server, and small clients the tests use), nodeK/
# (where node K's tensorfs is mounted) and testbed.env, the variables that
# describe it (sourced by tests).
#
# Each node's daemon runs in the node's network namespace, entered with
# nsenter --net only: its mount is the host's, so the CLI works from the
# host through each node's mount (tensorfs publish DIR/node1/model,
# tensorfs pull DIR/node2/model), and the daemon reaches etcd and its
# peers over the node's shaped link. (`ip netns exec` would give it a
# mount namespace of its own, hiding the mount.) Nodes are mounted with
# --allow-other (permissions are the kernel's, as on any mount) and
# --capacity SIZE (default 4G; the memory is taken only as segments fill
# it); each daemon logs where tensorfs mount says ("log /run/tensorfs/...").
# `down` unmounts DIR/node* (releasing their memory), stops every process
# in the test bed's namespaces and deletes them.
set -Eeuo pipefail

usage() {
	sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

die() {
	echo "cluster.sh: $*" >&2
	exit 1
}

[ "$(id -u)" -eq 0 ] || die "network namespaces and tc need root"
[ $# -ge 2 ] || usage
cmd=$1
shift

# testbed_id DIR: a short name for the test bed in DIR.
testbed_id() {
	realpath -m "$1" | sha256sum | cut -c1-6
}

# ns ID NAME: the namespace of NAME.
ns() {
	echo "tfs-$1-$2"
}

# packages the test bed uses, installed when one is missing.
ensure_packages() {
	local missing=()
	command -v ip >/dev/null 2>&1 || missing+=(iproute2)
	command -v openssl >/dev/null 2>&1 || missing+=(openssl)
	command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
	command -v iperf3 >/dev/null 2>&1 || missing+=(iperf3)
	command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
	if [ "${#missing[@]}" -gt 0 ]; then
		echo "cluster.sh: installing ${missing[*]}" >&2
		apt-get update -q >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
	fi
}

# certificate NAME IP: a key and a certificate of the cluster CA for NAME,
# naming NAME and IP, for client and server use.
certificate() {
	local name=$1 ip=$2 c=$dir/certs
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
		-keyout "$c/$name-key.pem" -out "$c/$name.csr" -subj "/CN=$name" 2>/dev/null
	printf 'subjectAltName=DNS:%s,IP:%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature\n' "$name" "$ip" >"$c/$name.ext"
	openssl x509 -req -in "$c/$name.csr" -CA "$c/ca.pem" -CAkey "$c/ca-key.pem" -CAcreateserial \
		-days 30 -extfile "$c/$name.ext" -out "$c/$name.pem" 2>/dev/null
	rm -f "$c/$name.csr" "$c/$name.ext"
	chmod 600 "$c/$name-key.pem"
}

# link ID NAME IP RATE: NAME's namespace, its veth to the switch, its
# address, and (RATE not empty) tbf shaping both ways.
link() {
	local id=$1 name=$2 ip=$3 rate=$4 sw
	sw=$(ns "$id" sw)
	local nsname
	nsname=$(ns "$id" "$name")
	ip netns add "$nsname"
	ip -n "$sw" link add "$name" type veth peer name eth0 netns "$nsname"
	ip -n "$sw" link set "$name" master br0 up
	ip -n "$nsname" link set lo up
	ip -n "$nsname" addr add "$ip/24" dev eth0
	ip -n "$nsname" link set eth0 up
	if [ -n "$rate" ]; then
		# burst: enough for a 64 KiB GSO segment and a few ms at the rate.
		tc -n "$nsname" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 20ms
		tc -n "$sw" qdisc add dev "$name" root tbf rate "$rate" burst 256kb latency 20ms
	fi
}

# start_etcd ID: etcd in its namespace, waiting until it serves.
start_etcd() {
	local id=$1 i
	mkdir -p "$dir/etcd"
	nsenter --net="/var/run/netns/$(ns "$id" etcd)" setsid "$dir/bin/tensorfs-testbed" etcd \
		-dir "$dir/etcd/data" -listen 10.99.0.254:2379 \
		-ca "$dir/certs/ca.pem" -cert "$dir/certs/etcd.pem" -key "$dir/certs/etcd-key.pem" \
		</dev/null >"$dir/etcd.log" 2>&1 &
	for i in $(seq 1 300); do
		if grep -q "etcd ready" "$dir/etcd.log" 2>/dev/null; then
			return 0
		fi
		if ! kill -0 $! 2>/dev/null || [ "$i" -eq 300 ]; then
			cat "$dir/etcd.log" >&2
			die "etcd did not start (log above, in $dir/etcd.log)"
		fi
		sleep 0.1
	done
}

# mount_node ID K [FLAGS...]: node K's tensorfs at DIR/nodeK, its daemon in
# node K's network namespace, with the cluster's flags and FLAGS.
mount_node() {
	local id=$1 k=$2
	shift 2
	nsenter --net="/var/run/netns/$(ns "$id" "node$k")" "$dir/bin/tensorfs" mount \
		--allow-other --capacity "$capacity" \
		--cluster https://10.99.0.254:2379 --node "node$k" --cluster-ca "$dir/certs/ca.pem" \
		--cluster-cert "$dir/certs/node$k.pem" --cluster-key "$dir/certs/node$k-key.pem" \
		"$@" "$dir/node$k" >/dev/null
}

up() {
	[ $# -ge 2 ] || usage
	local n=$1 rate=1gbit
	capacity=4G
	dir=$2
	shift 2
	while [ $# -gt 0 ]; do
		case $1 in
		--rate)
			[ $# -ge 2 ] || usage
			rate=$2
			shift 2
			;;
		--capacity)
			[ $# -ge 2 ] || usage
			capacity=$2
			shift 2
			;;
		*) usage ;;
		esac
	done
	[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "N must be 1 to 200, not '$n'"
	local id
	id=$(testbed_id "$dir")
	if ip netns list | grep -q "^tfs-$id-"; then
		die "a test bed is up in $dir already (namespaces tfs-$id-*): scripts/cluster.sh down $dir first"
	fi
	ensure_packages
	mkdir -p "$dir"
	dir=$(realpath "$dir")
	local repo
	repo=$(cd "$(dirname "$0")/.." && pwd)

	local go=go
	command -v go >/dev/null 2>&1 || go=/usr/local/go/bin/go
	mkdir -p "$dir/bin" "$dir/certs"
	if [ -n "${TENSORFS_TESTBED_BIN:-}" ]; then
		cp "$TENSORFS_TESTBED_BIN" "$dir/bin/tensorfs-testbed"
	else
		(cd "$repo" && "$go" build -o "$dir/bin/tensorfs-testbed" ./cluster/internal/testbed)
	fi
	if [ -n "${TENSORFS_BIN:-}" ]; then
		cp "$TENSORFS_BIN" "$dir/bin/tensorfs"
	else
		(cd "$repo" && "$go" build -o "$dir/bin/tensorfs" ./cmd/tensorfs)
	fi

	openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
		-keyout "$dir/certs/ca-key.pem" -out "$dir/certs/ca.pem" -days 30 \
		-subj "/CN=tensorfs test bed CA" 2>/dev/null
	chmod 600 "$dir/certs/ca-key.pem"
	certificate etcd 10.99.0.254
	local k
	for k in $(seq 1 "$n"); do
		certificate "node$k" "10.99.0.$k"
	done

	trap 'echo "cluster.sh: up failed; removing what it made" >&2; down_id "$id" "$dir"' ERR
	local sw
	sw=$(ns "$id" sw)
	ip netns add "$sw"
	ip -n "$sw" link add br0 type bridge
	ip -n "$sw" link set br0 up
	link "$id" etcd 10.99.0.254 ""
	for k in $(seq 1 "$n"); do
		link "$id" "node$k" "10.99.0.$k" "$rate"
		mkdir -p "$dir/node$k"
	done

	start_etcd "$id"
	cat >"$dir/testbed.env" <<-ENV
		TESTBED_ID=$id
		TESTBED_N=$n
		TESTBED_RATE=$rate
		TESTBED_CAPACITY=$capacity
		TESTBED_ETCD=https://10.99.0.254:2379
		TESTBED_CA=$dir/certs/ca.pem
		TESTBED_CERTS=$dir/certs
		TESTBED_BIN=$dir/bin/tensorfs-testbed
		TESTBED_TENSORFS=$dir/bin/tensorfs
	ENV
	for k in $(seq 1 "$n"); do
		mount_node "$id" "$k"
	done
	trap - ERR
	echo "cluster.sh: $n nodes at 10.99.0.1-$n ($rate links), tensorfs mounted at $dir/node1-$n, etcd at https://10.99.0.254:2379; see $dir/testbed.env"
}

# remount DIR K [FLAGS...]: mount node K again.
remount() {
	[ $# -ge 2 ] || usage
	dir=$(realpath "$1")
	local k=$2
	shift 2
	[ -f "$dir/testbed.env" ] || die "no test bed in $dir"
	capacity=$(sed -n 's/^TESTBED_CAPACITY=//p' "$dir/testbed.env")
	local n
	n=$(sed -n 's/^TESTBED_N=//p' "$dir/testbed.env")
	[[ $k =~ ^[0-9]+$ ]] && [ "$k" -ge 1 ] && [ "$k" -le "$n" ] || die "no node $k in the test bed in $dir (nodes 1 to $n)"
	mount_node "$(testbed_id "$dir")" "$k" "$@"
}

# etcd_ctl DIR stop|start: stop etcd (as a crash would) or start it again.
etcd_ctl() {
	[ $# -eq 2 ] || usage
	dir=$(realpath "$1")
	local id pids
	id=$(testbed_id "$dir")
	case $2 in
	stop)
		pids=$(ip netns pids "$(ns "$id" etcd)" || true)
		[ -z "$pids" ] || kill -9 $pids
		;;
	start) start_etcd "$id" ;;
	*) usage ;;
	esac
}

# down_id ID DIR: unmount the nodes' mounts, stop every process in the
# test bed's namespaces, delete them and what up wrote to DIR.
down_id() {
	local id=$1 d=$2 m nsname
	for m in "$d"/node*; do
		if [ -d "$m" ] && mountpoint -q "$m"; then
			if [ -x "$d/bin/tensorfs" ]; then
				"$d/bin/tensorfs" unmount --purge "$m" >/dev/null 2>&1 || umount -l "$m"
			else
				umount "$m" 2>/dev/null || umount -l "$m"
			fi
		fi
	done
	for nsname in $(ip netns list | awk '{print $1}' | grep "^tfs-$id-" || true); do
		local pids
		pids=$(ip netns pids "$nsname" || true)
		if [ -n "$pids" ]; then
			kill $pids 2>/dev/null || true
			for _ in $(seq 1 50); do
				pids=$(ip netns pids "$nsname" || true)
				[ -z "$pids" ] && break
				sleep 0.1
			done
			[ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
		fi
		ip netns delete "$nsname"
	done
	rm -rf "$d/certs" "$d/etcd" "$d/etcd.log" "$d/bin" "$d/testbed.env"
	for m in "$d"/node*; do
		[ -d "$m" ] && rmdir "$m" 2>/dev/null || true
	done
	rmdir "$d" 2>/dev/null || true
}

down() {
	[ $# -eq 1 ] || usage
	down_id "$(testbed_id "$1")" "$1"
}

# exec DIR NAME CMD...: CMD in NAME's network namespace, in the host's mount
# namespace.
exec_in() {
	[ $# -ge 3 ] || usage
	local d=$1 name=$2
	shift 2
	local path
	path=/var/run/netns/$(ns "$(testbed_id "$d")" "$name")
	[ -e "$path" ] || die "no namespace for $name in the test bed in $d"
	exec nsenter --net="$path" "$@"
}

case $cmd in
up) up "$@" ;;
down) down "$@" ;;
exec) exec_in "$@" ;;
mount) remount "$@" ;;
etcd) etcd_ctl "$@" ;;
*) usage ;;
esac
