// Package cluster takes tensorfs beyond one node: published directories
// are recorded in etcd, and their segments move between nodes piece by
// piece, each node serving every verified piece it holds (DESIGN.md §10).
//
// Nothing here runs unless the daemon joins a cluster (Join). The package
// knows nothing of FUSE or of the backing store: the fs side hands it
// files (io.ReaderAt to publish or offer, *os.File to pull into) and
// metadata (Entry), and shows what Version returns.
//
// # Key layout
//
// Every key lives under Config.Prefix (default "/tensorfs/"), so several
// clusters can share one etcd. P is that prefix; VID and CID are hex
// SHA-256 digests, NODE a node name, DIR and PATH clean relative paths.
//
//	P nodes/NODE          {"addr":"host:port"}: NODE's piece server. Tied to the
//	                      daemon's lease; created only if absent (a transaction
//	                      on CreateRevision == 0), so two live daemons cannot
//	                      share a name.
//	P dirs/DIR            {"version":VID,"publisher":NODE,"uid":UID,"time":...,
//	                      "prev":VID,"kept":[VID...]}: the current version of a
//	                      published directory, who published it, and the earlier
//	                      versions it keeps. Replaced by a transaction that
//	                      commits only if no dirs/ key changed since the
//	                      publisher read them (compare-and-swap), so concurrent
//	                      publishers are ordered, none is lost, and the bounds
//	                      checked on what it read hold (PublishOptions.Admit).
//	                      Deleted, with the versions it keeps, by Unpublish.
//	P versions/VID        {"entries":N,"bytes":B,"manifest":M}: M is the bytes of
//	                      VID's keys. Written before VID's other keys; a version
//	                      is complete once a dirs/ key names it.
//	P entries/VID/PATH    Entry (JSON): one file or directory of version VID; "."
//	                      is the directory itself. VID is the SHA-256 over the
//	                      entries' encodings in path order ("." first), each
//	                      preceded by its length in decimal and a newline.
//	P contents/CID        Content (JSON): size, piece size, SHA-256 of each piece.
//	                      CID is the SHA-256 of this value: equal bytes have one
//	                      CID across paths and versions.
//	P refs/CID/VID        "": version VID uses content CID. Written after VID's
//	                      header and before the content.
//	P holders/CID/NODE    "complete" (NODE holds every piece of CID, verified) or
//	                      "partial" (a member: it pulls CID, or lost a piece).
//	                      Written when NODE begins to hold CID and when that
//	                      changes, not as pieces arrive: which pieces a member
//	                      holds, a puller learns from it over the transport
//	                      (transport.Transport.Watch). Tied to NODE's lease, so
//	                      a dead node's entries vanish with it; written only in
//	                      a transaction that checks NODE's key still carries
//	                      that lease; deleted when NODE drops CID.
//
// Versions, entries and contents are immutable and content-addressed:
// rewriting one writes the same bytes. Publishing writes the version key,
// references, contents and entries, then the publisher's holder keys, then
// swaps dirs/DIR; a publish that dies part way leaves unreferenced
// immutable keys and no visible change. The swap deletes, in the same
// transaction, the entries and version keys of the versions no directory
// keeps any longer (a directory keeps PublishOptions.Keep); then their
// references go, unless the version was written again meanwhile, and each
// content whose references are all gone. A publish whose version such a
// swap deleted writes it again before its own swap, which requires its
// version key. Readers of a kept version are not disturbed.
//
// Holder lists differ from Mooncake's P2P Store, which keeps one JSON
// replica list per object and updates it by compare-and-swap on its
// ModRevision: etcd ties a lease to a whole key, and N nodes announcing
// pieces at once would contend on one key. Here each node writes only its
// own key per content (its lease makes it vanish with the node), and the
// compare in each transaction is on the node's ownership of its name.
// The keys carry membership, not bitmaps: every puller watches a
// content's holder keys, so a bitmap rewritten per piece was an event at
// every puller, N² per piece in all. A puller subscribes instead to a
// sample of up to 32 members (the scheduler's), which send it their
// bitmaps and then each piece they get.
//
// # Failures
//
// Every call that needs etcd gives up after Config.Timeout with
// ErrUnavailable, and every retry waits Backoff (exponential, with
// jitter). Watches (watchPrefix) read a snapshot, watch from its
// revision, and when the watch breaks (history compacted, etcd gone)
// read the keys again and apply the difference, deletions included. The
// data path (fetching from holders already known)
// does not need etcd, and announcements wait for it to return. When the
// lease is lost (etcd unreachable for longer than its TTL), the node joins
// again with a new lease and announces everything it holds.
package cluster
