// Package ctl is tensorfs's control socket (DESIGN.md §7), in the spirit of
// PyTorch's IpcChannel (send_fd, recv_fd, all_gather_fds, broadcast_fds):
// clients receive a segment's descriptor (export), receive every segment
// under a directory with its descriptor and tensor attributes in one
// request (load), turn a descriptor of their own into a segment without a
// copy (import), and exchange
// descriptors among the local ranks of a named group (all_gather,
// broadcast); the daemon's own user and root may also ask it to purge its
// backing when it exits (purge). A daemon in a cluster also publishes a
// directory cluster-wide (publish) and pulls what a published directory
// holds from its peers (pull). It knows nothing of FUSE: the segment
// operations are served by a Backend, which package fs implements, and
// every request carries the peer's credentials as the kernel recorded
// them when the peer connected (SO_PEERCRED and SO_PEERGROUPS: pid, uid,
// gid and supplementary groups, never read again later), against which
// the backend checks permissions.
//
// # Transport
//
// The daemon listens on a unix socket of type SOCK_SEQPACKET whose mode is
// 0666 (permissions are checked per request, not by the socket's mode).
// A session is a sequence of request/reply pairs on one connection: the
// client sends one request message and reads one reply message before
// sending the next (requests are answered in order, so ranks that wait in
// groups concurrently need a connection each). Each request and each reply
// is exactly one SOCK_SEQPACKET message, whose bytes are one JSON object
// (UTF-8, RFC 8259). Descriptors travel as SCM_RIGHTS ancillary data
// attached to that same message. A zero-length message, like closing the
// socket, ends the session: the daemon closes its end (and any descriptor
// that came with it) without a reply.
//
// # Requests
//
// A request is a JSON object with exactly the members listed for its op.
// Every request has
//
//	"v"   integer, required, must be 1 (the protocol version)
//	"op"  string, required: "export", "import", "load", "all_gather", "broadcast",
//	      "purge", "publish", "pull" or "unpublish"
//
// and, by op (fds is the number of descriptors attached):
//
//	op          members                                         fds
//	export      "path" (required), "write" (bool, optional)     0
//	import      "path" (required), "dtype", "shape" (optional)  1
//	load        "path" (required), "write" (bool, optional),    0
//	            "after" (optional)
//	all_gather  "group", "rank", "world" (all required),         1
//	            "open" (bool, optional)
//	broadcast   "group", "rank", "world", "root" (required),     1 if rank == root, else 0
//	            "open" (bool, optional)
//	purge       none                                            0
//	publish     "path" (required)                               0
//	pull        "path" (required)                               0
//	unpublish   "path" (required)                               0
//
// Member names are case-sensitive and may appear once. A member that is
// not listed for the op, a missing required member, a value of the wrong
// JSON type (null included; integers must be written without fraction or
// exponent), or anything after the object is an error (EINVAL). Strings:
//
//   - path: the segment, relative to the mount root, 1 to 4096 bytes.
//     Absolute paths, paths with a ".." component or a NUL byte, and paths
//     that name the root itself ("." or "./") are refused with EINVAL; a
//     longer path with ENAMETOOLONG. Redundant "/" and "." are removed
//     before the backend sees the path ("a//./b/" is "a/b").
//   - path (load): a directory, as above, except that "." (or "./") names
//     the mount root.
//   - path (publish, pull, unpublish): a directory, as for export (not the root).
//   - write (export, load): true asks for read-write descriptors; default
//     false (read-only).
//   - after (load): resume the listing after the segment of this name (the
//     last one of the previous reply); "" or absent starts from the
//     beginning. At most 4096 bytes, no NUL byte.
//   - dtype, shape (import): the segment's user.tensor.dtype and
//     user.tensor.shape, e.g. "float32" and "[1024, 768]"; "" or absent
//     leaves them unset. The backend validates them.
//   - group: 1 to 256 bytes, no NUL byte.
//   - open (all_gather, broadcast): true joins the open group of that
//     name, which every uid may join, rather than the requester's uid's
//     own; default false. See Groups.
//
// Integers: 1 <= world <= 253, 0 <= rank < world, 0 <= root < world. The
// bound on world is the kernel's limit on descriptors in one message
// (SCM_MAX_FD), since an all_gather reply carries world descriptors.
//
// A request message may be at most 65536 bytes. The daemon accepts at most
// 16 descriptors on one message; more are an error (EINVAL).
//
// # Replies
//
// Success is
//
//	{"v":1,"ok":true}              no descriptor attached
//	{"v":1,"ok":true,"fds":N}      N descriptors attached (SCM_RIGHTS)
//
// where export returns 1 (the segment, O_RDONLY or O_RDWR as asked),
// import 0, all_gather world descriptors in rank order (rank 0 first, the
// caller's own included), broadcast 1 (the root's descriptor) to every
// rank but the root, which gets 0, and purge, publish and pull 0. Purge succeeds only for
// the daemon's own uid and root (others: EACCES, and nothing changes);
// it does not unmount anything: the daemon purges its backing when it
// exits, once unmounted and its last user gone (what "tensorfs unmount
// --purge" asks for). A load reply adds
//
//	"segments": [{"name":"layer/0/weight","size":2048,"fd":0,"flags":"SHAREDMEM",
//	              "dtype":"float32","shape":"[16, 32]","stride":"","offset":"","links":1}, ...]
//	"more": true                   only when the listing goes on
//
// listing the regular files under the directory, depth first with the
// entries of each directory in byte order (so names compare component by
// component), name relative to the directory with "/" separators, size
// in bytes, and the stored flags and tensor attributes in their canonical
// spellings (absent or "" when unset), and links, the number of names
// of its inode when listed (1: no other name shares its bytes; a client
// maps each inode once). "fd" is the index of the
// segment's descriptor among those attached (O_RDONLY, or O_RDWR with
// "write"), or -1 where the daemon hands out none: imported (FROMFD)
// segments, whose bytes are their sender's file, and GPU segments; open
// those through the mount. A reply carries at most 253 descriptors (fewer
// when the peer's descriptor limit is lower) and fits in 65536 bytes;
// with "more", send the request again with "after" set to the last name.
// On the same connection (the next load request it sends, of the same
// path), the daemon resumes from what the last request read of each
// directory: the listing is each directory as that load first read it,
// less the entries removed since, and a directory it listed segments from,
// or was listing, that is another one now (renamed away and replaced)
// fails the request with ESTALE rather than listing two directories as
// one; load again from the start. On another connection "after" resumes
// by name in the directories as they are.
// Permissions are open(2)'s: search permission on every directory from
// the root, read and search on every directory listed, read (and write
// with "write") on every segment; one refusal refuses the request (EACCES,
// naming the path), and so does "write" with a FROMFD segment (EPERM).
// Descriptors handed out by export and load are not counted in a
// segment's user.tensorfs.refcount or holders.
//
// A publish reply adds "version": the ID of the version made (64 hex
// digits), once every segment below the directory is hashed and the
// version is in the cluster's namespace; those segments are read-only on
// every node from then on. The peer must own the directory or may write
// it, may read and search every directory below, may read and write every
// segment not yet published (publishing freezes it) and read every one
// published already. Refused: segments of other kinds (GPU, imported,
// SHARED) and pulled segments not complete on this node (EINVAL), a
// segment open for writing (EBUSY), objects that are neither segments nor
// directories (EINVAL). A pull reply, sent once every segment below the
// directory that was not complete on this node is (or one failed), adds
// "bytes": the bytes fetched. The peer must be able to search every
// directory on the way, read and search every directory below and read
// every segment it fetches. While it runs, user.tensorfs.cluster on the
// directory shows its progress. An unpublish reply (no members) comes
// once the directory is gone from the namespace and from this node (every
// other node removes it as its watch reports it); only the directory's
// publisher's uid or root may ask (EPERM, naming that uid). These ops block their connection for as
// long as they take (a pull, as long as the transfer); on a daemon that
// joined no cluster they fail with EOPNOTSUPP. Cluster failures have
// their own errnos: ETIMEDOUT (etcd did not answer within its timeout:
// down, unreachable, or refusing this node's certificate), EHOSTUNREACH
// (no live node holds a piece still needed), ENOSPC (the pull does not
// fit; nothing of it is kept), EBADMSG (what the cluster holds does not
// match its content address), ENOENT (the directory is not published).
//
// Failure is
//
//	{"v":1,"ok":false,"errno":E,"error":"why"}
//
// with E a positive Linux errno and "why" a human-readable reason; no
// descriptor comes with a failure. Replies never exceed 65536 bytes. A
// client receives with room for 253 descriptors of ancillary data
// (CMSG_SPACE(253*4) bytes), preferably with MSG_CMSG_CLOEXEC, and checks
// that "fds" matches the descriptors attached; members it does not know
// may be ignored.
//
// Errors the daemon itself answers (others come from the backend):
//
//	EPROTONOSUPPORT  "v" is not 1
//	EOPNOTSUPP       unknown "op", or load or purge on a daemon that does
//	                 not serve it
//	EINVAL           not a JSON object, bad member, bad path or group,
//	                 integer out of range, wrong number of descriptors,
//	                 inconsistent group membership (below), a descriptor
//	                 for all_gather or broadcast that is no memory to
//	                 map (a FIFO, socket, block device, directory or
//	                 O_PATH descriptor)
//	ENAMETOOLONG     path longer than 4096 bytes
//	EMSGSIZE         request longer than 65536 bytes (MSG_TRUNC)
//	ETIMEDOUT        the group did not fill in time (below)
//	EACCES           the mount is private and the peer is not its user
//	                 (below), or purge from a uid other than the
//	                 daemon's and root
//	EAGAIN           the peer's uid, all users but root together, or all
//	                 users together reached a limit (below)
//
// After an error reply the connection stays usable, except after EACCES
// or a limit on connections (below); every descriptor that came with a
// refused request has been closed by the daemon.
//
// # Access and limits
//
// A mount without --allow-other is private: its socket serves only the
// daemon's uid and root, whatever the op. Any other uid's connection is
// turned away: its first request is answered EACCES and the daemon closes
// it.
//
// The daemon bounds what peers may hold in it, per uid and for all users
// together: open connections (default 448 per uid, 4096 in all),
// all_gather and broadcast requests waiting for their group (280, 2560),
// and descriptors held for peers, those received and not yet closed plus
// 4 for each export, import, publish or pull being served and 4 plus the
// reply's room for each load (896, 8192). The totals are lowered, if need
// be, so that the descriptors the socket may hold stay within half of the
// daemon's RLIMIT_NOFILE: the other half is FUSE's. An eighth of each
// total is root's alone: uids other than root stop at the other seven
// eighths together, and each at an eighth of that (the per-uid numbers
// above), so that at least eight users fit and none shuts root out; root
// is bound by the total alone. The daemon logs the limits it chose.
// A request that would exceed a limit is answered EAGAIN, with the uid
// and the limit in "error" (and in the daemon's log); its descriptors are
// closed, and the connection stays usable. A connection over the limit on
// connections is turned away as above, with EAGAIN. A connection turned
// away that sends nothing for a second, or while many others are being
// turned away, is closed without a reply. A rank that completes its group
// never needs room among the waiting requests.
//
// # Groups
//
// all_gather and broadcast are collective: each of the world ranks of a
// group sends one request on its own connection, and the daemon replies to
// all of them once the last has arrived; then the group name is free for
// the next round. A group is its uid's: requests join the group of their
// name among those of the requester's uid (SO_PEERCRED), so the same name
// used by two uids, root included, is two groups, and no uid receives
// another's descriptors. A group with "open": true is keyed by its name
// alone, apart from every uid's own groups, and takes ranks from any uid
// that asks for it so: every rank must set it (a rank that does not joins
// its uid's own group of that name instead). Join an open group only with
// ranks you trust: each receives every member's descriptor, with the
// access it was sent with. The first request names the group and fixes
// its op, world and root (broadcast). A later request must agree on op,
// world and root and bring a rank not yet taken: otherwise that request
// alone is refused (EINVAL) and the group keeps waiting. A rank whose
// connection closes while it waits leaves the group (its descriptor is
// closed: the daemon closes peers' descriptors off its locks, so a close
// that blocks holds up no one else, and counts them until closed) and the rank may be joined again (a connection that sent a
// further request meanwhile is noticed only once the group completes or
// times out); a group whose last member leaves is forgotten. If a group is not full within the daemon's wait
// limit (60 s by default) counted from its first request, every waiting
// rank gets ETIMEDOUT and the group is forgotten. In a broadcast the root
// too is answered only when all ranks have joined.
//
// # Example
//
// Export, then all_gather of rank 1 of 2 (descriptors shown in brackets):
//
//	-> {"v":1,"op":"export","path":"model/w0","write":false}
//	<- {"v":1,"ok":true,"fds":1}                                     [segment]
//	-> {"v":1,"op":"all_gather","group":"step7","rank":1,"world":2}  [mine]
//	<- {"v":1,"ok":true,"fds":2}                                     [rank0, rank1]
//
// In Python:
//
//	s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
//	s.connect(path)  # os.getxattr(mountpoint, "user.tensorfs.socket")
//	s.sendmsg([json.dumps(req).encode()],
//	          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
//	data, anc, flags, _ = s.recvmsg(65536, socket.CMSG_SPACE(253 * 4), socket.MSG_CMSG_CLOEXEC)
//	rep = json.loads(data)
//	got = [fd for level, typ, d in anc if (level, typ) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
//	       for fd in array.array("i", d[:len(d) - len(d) % 4])]
package ctl
