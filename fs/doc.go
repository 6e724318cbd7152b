// Package fs is tensorfs's FUSE front end: the only package that imports
// go-fuse. It translates FUSE requests and control-socket requests into
// operations on the backing store of package alloc, and maps their errors
// to errnos (toErrno). The model is written down in the repository's
// DESIGN.md (§11 kinds, §12 lifecycle, §13 locks); this is its summary.
//
// # Objects and kinds
//
// Each object kind is a node type of its own, in go-fuse's idiom, and
// serves exactly the operations written on it: dirNode (and rootNode, the
// mount's root), segmentNode, symlinkNode and specialNode (FIFOs,
// sockets, device nodes, which the kernel serves). Their shared
// operations are nodeBase's. Every node answers ioctl with ENOTTY.
//
// A segment's kind says where its bytes and attributes live, and is one
// value of the storage interface (storage.go), decided once by classify
// from the marker its backing file holds: host (the backing file itself),
// shared (a file on --disk), imported (a descriptor a client sent),
// device (GPU memory), pulled (a read-only segment of a directory
// published to a cluster, whose backing file holds its bytes once pulled;
// cluster.go is the mount's side of the cluster). Handles are of two types: fileHandle, for bytes in
// a host file (passthrough or read and write by the daemon), and
// deviceHandle. The control socket's export and load reach segments
// through the same classify and storage methods.
//
// Every access to a backing object by name goes through an alloc.Ref: an
// O_PATH descriptor opened without following a symbolic link and checked
// to be the node's inode; a real open reopens that very descriptor. A
// name that moved since the kernel looked it up is ESTALE.
//
// # Locks
//
// From outermost to innermost; a lock is never taken while one below it
// in this list is held:
//
// Outermost, gateFS.mu (read: every FUSE request; write: a handover),
// then HandoverFS.mu (across Adopt's lookups and opens, before the daemon
// serves; otherwise a leaf, under which the journal is sent); then:
//
//  0. clusterFS.nsMu (a publish, or a published version being made)
//  1. segmentNode.opening (read: an open; write: a device change, or a
//     publish freezing the segment)
//  2. attrCache.mu (filling or changing a node's cached attributes)
//  3. dirFds.mu (the directory descriptor cache; never held across a
//     call that opens a descriptor)
//  4. devSeg.mu, then devSeg.cmu (a device segment's memory, then its
//     consumer counter; the limbo's predicates take cmu alone)
//  5. segmentNode.mu, importedFile.mu, imports.mu, devices.mu,
//     devices.growMu, mapTable.mu, watchSet.mu, pidfds.mu, inodes.mu,
//     servedFds.mu (leaves: only the ledger's locks are taken while one
//     is held); and clusterFS.mu, then pulledSet.mu (which calls
//     cluster.Node.Drop), then pulled.mu
//  6. ledger.Row.mu (the innermost: a charge is taken or given under the
//     lock of what it counts)
//
// A helper that expects a lock held says so in its name (…Locked).
//
// # Data and the daemon
//
// Data never passes through the daemon in passthrough mode: opens hand
// the kernel a backing descriptor (FOPEN_PASSTHROUGH) and read, write and
// mmap run against the backing file. Without passthrough the daemon
// serves read and write from the same descriptor. The daemon must never
// mmap a file of its own mount (go-fuse's documented deadlock); tests do
// that from child processes.
package fs
