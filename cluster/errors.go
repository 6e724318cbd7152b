package cluster

import "errors"

// Errors of the cluster calls, wrapped with what failed.
var (
	// ErrUnavailable is returned when etcd does not answer within the
	// configured timeout, or this node has not (yet) joined: the call
	// may succeed once etcd is back. Local segments are unaffected.
	ErrUnavailable = errors.New("cluster unavailable")
	// ErrNotPublished is returned for a directory or content that is not
	// published.
	ErrNotPublished = errors.New("not published")
	// ErrInvalid is returned for a bad name or a bad entry to publish.
	ErrInvalid = errors.New("invalid")
	// ErrNotPublisher is returned for a publish or unpublish of a
	// directory another uid published: only that uid, or root, may
	// change it.
	ErrNotPublisher = errors.New("published by another uid")
	// ErrTooLarge is returned for an entry whose encoding would exceed
	// what one etcd value of a manifest may take (its attributes).
	ErrTooLarge = errors.New("entry too large to publish")
	// ErrCorrupt is returned when what etcd holds does not match its
	// content address, or a version is incomplete.
	ErrCorrupt = errors.New("corrupt manifest")
	// ErrBadCopy is returned when bytes this node holds no longer match
	// their published hashes (its file was changed under it): they are
	// not served or copied, and are fetched from peers when pulled again.
	ErrBadCopy = errors.New("bytes held here do not match their published hashes")
	// ErrNameInUse is returned while another live daemon holds this
	// node's name.
	ErrNameInUse = errors.New("node name in use")
	// ErrNoHolder is returned by a pull when no live node holds a piece
	// it still needs for longer than the configured wait.
	ErrNoHolder = errors.New("no node holds the piece")
	// ErrBusy is returned when a content is already being pulled by this
	// node.
	ErrBusy = errors.New("content already being pulled")
	// ErrClosed is returned after Close.
	ErrClosed = errors.New("cluster node closed")
)
