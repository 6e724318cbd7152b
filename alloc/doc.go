// Package alloc owns tensorfs's segments: the backing directory on tmpfs
// that mirrors the mount, segment flags and tensor metadata stored as
// xattrs on the backing files, capacity (pages reserved on growth) and
// recovery after a crash. It knows nothing of FUSE and returns Go errors,
// sentinel ones from errors.go where a caller must tell them apart.
//
// Backing objects are reached through descriptors: an O_PATH descriptor
// of the directory that holds them and a name, which At opens with
// O_NOFOLLOW and hands to the attribute calls as /proc/self/fd/M, a path
// that names that very inode. No operation builds a path from the backing
// root or walks a name below /proc/self/fd/N, so a symbolic link planted
// or renamed into place is never followed, and deep trees and directories
// renamed while open work as they do on tmpfs. The backing is private to
// the daemon (mode 0700), and its own bookkeeping (import and disk ids,
// device state) is kept in trusted.* attributes when it runs as root.
package alloc
