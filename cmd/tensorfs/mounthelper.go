package main

import (
	"fmt"
	"io"
	"strings"
)

// helperName is the name mount(8) runs for "mount -t fuse.tensorfs" and
// fstab entries of that type; install it as a link to tensorfs.
const helperName = "mount.fuse.tensorfs"

// runMountHelper serves mount(8)'s calling convention,
// "SPEC DIR [-sfnv] [-N NS] [-o OPTS] [-t TYPE]", by turning the -o
// options into tensorfs mount flags. SPEC is ignored: the backing is
// chosen by the options, as with tensorfs mount.
func runMountHelper(args []string, stdout, stderr io.Writer) int {
	var pos, flags []string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "-o" && i+1 < len(args):
			i++
			opts, err := mountOptions(args[i])
			if err != nil {
				fmt.Fprintf(stderr, "%s: %v\n", helperName, err)
				return 2
			}
			flags = append(flags, opts...)
		case (a == "-t" || a == "-N") && i+1 < len(args):
			i++ // the type is ours; namespaces are not supported
		case strings.HasPrefix(a, "-"):
			// -s (sloppy), -f (fake), -n (no mtab), -v (verbose)
		default:
			pos = append(pos, a)
		}
	}
	if len(pos) != 2 {
		fmt.Fprintf(stderr, "usage: %s SPEC MOUNTPOINT [-o capacity=8G,disk=DIR,allow_other,...]\n", helperName)
		return 2
	}
	return runMount(append(flags, pos[1]), stdout, stderr)
}

// mountOptions translates fstab options to tensorfs mount flags; generic
// options that mount(8) or systemd handle themselves are dropped.
func mountOptions(list string) ([]string, error) {
	var flags, endpoints []string
	for _, opt := range strings.Split(list, ",") {
		key, val, hasVal := strings.Cut(opt, "=")
		switch {
		case opt == "" || generic(key):
		case key == "capacity" || key == "inodes" || key == "backing" || key == "disk" || key == "gpu" || key == "node" ||
			key == "cluster_ca" || key == "cluster_cert" || key == "cluster_key" || key == "cluster_listen" ||
			key == "etcd_quota" || key == "cluster_user_bytes" || key == "cluster_user_entries" || key == "cluster_user_dirs" ||
			key == "cluster_keep" || key == "cluster_node_inodes" || key == "cluster_node_bytes":
			if !hasVal {
				return nil, fmt.Errorf("option %s needs a value, as in %s=...", key, key)
			}
			flags = append(flags, "--"+strings.ReplaceAll(key, "_", "-"), val)
		case key == "cluster":
			// One endpoint per option: fstab separates options with commas.
			if !hasVal {
				return nil, fmt.Errorf("option cluster needs an etcd endpoint, as in cluster=https://10.0.0.1:2379")
			}
			endpoints = append(endpoints, val)
		case (key == "allow_other" || key == "debug" || key == "no_passthrough" || key == "huge_pages") && !hasVal:
			flags = append(flags, "--"+strings.ReplaceAll(key, "_", "-"))
		default:
			return nil, fmt.Errorf("unknown option %q (tensorfs takes capacity, backing, disk, gpu, allow_other, no_passthrough, huge_pages, debug, "+
				"cluster, node, cluster_ca, cluster_cert, cluster_key, cluster_listen, etcd_quota, cluster_user_bytes, cluster_user_entries, "+
				"cluster_user_dirs, cluster_keep, cluster_node_inodes, cluster_node_bytes)", opt)
		}
	}
	if len(endpoints) > 0 {
		flags = append(flags, "--cluster", strings.Join(endpoints, ","))
	}
	return flags, nil
}

// generic reports whether an fstab option belongs to mount(8) or systemd
// rather than to tensorfs.
func generic(key string) bool {
	switch key {
	case "rw", "defaults", "auto", "noauto", "nofail", "user", "users", "nouser", "_netdev",
		"dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime", "relatime":
		return true
	}
	return strings.HasPrefix(key, "x-") || strings.HasPrefix(key, "comment=")
}
