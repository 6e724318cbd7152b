// Package alloc owns tensorfs's segments: the backing directory on tmpfs
// that mirrors the mount, segment flags and tensor metadata stored as
// xattrs on the backing files, capacity (pages reserved on growth) and
// recovery after a crash. It knows nothing of FUSE and returns Go errors,
// sentinel ones from errors.go where a caller must tell them apart.
//
// Backing objects are addressed by paths under /proc/self/fd/N, where N is
// an O_PATH descriptor of the directory that holds them: no operation ever
// builds a path from the backing root, so deep trees and directories
// renamed while open work as they do on tmpfs. Attribute calls follow the
// path (a /proc/self/fd link of an unnamed segment must be followed); the
// front end answers attribute requests on symbolic links itself.
package alloc
