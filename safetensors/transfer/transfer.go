// Package transfer copies safetensors files into a directory of a tensorfs
// mount, one segment per tensor, and back out.
//
// Import writes one segment per tensor under DIR (a name "a/b" becomes the
// segment b in the directory a) with user.tensor.dtype and
// user.tensor.shape set, or, with Options.PackBelow, the small tensors
// together in DIR's pack (PackName), and records on DIR what a segment
// cannot hold:
//
//	user.safetensors.meta.KEY  each "__metadata__" entry
//	user.safetensors.order     the tensor names in header order, a JSON list
//	user.safetensors.header    the original header, only when it is not the
//	                           one export would rebuild (see below)
//
// Export rebuilds the header the way the reference writer lays it out:
// compact JSON, "__metadata__" first, the tensors in recorded order (then
// any new ones, largest element size first so that data stays aligned,
// then by name), packed back to back. A file written by the reference
// writer therefore exports byte-identical without anything more; for any
// other file (different JSON spacing or key order, data not in key order,
// an empty "__metadata__"...) import keeps the original header bytes, and
// export reuses them, offsets and all, as long as every tensor still has
// its recorded name, dtype and shape and the metadata is unchanged. An
// unchanged import thus always exports byte-identical.
//
// Attribute values over 64 KiB (the kernel's limit) are split: NAME holds
// the first 64 KiB, NAME.1, NAME.2... the rest.
//
// Both are all or nothing: a failed or interrupted import leaves DIR as it
// found it (a directory it created is removed), and export writes a
// temporary file that it renames into place once complete and synced.
// Bytes move with copy_file_range where the kernel can (both files on one
// filesystem), otherwise with a few workers reading and writing in
// parallel, so that a copy runs at memory speed rather than at the speed
// of one thread.
package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

const (
	attrSTPrefix = "user.safetensors."
	attrSTMeta   = attrSTPrefix + "meta."
	attrSTOrder  = attrSTPrefix + "order"
	attrSTHeader = attrSTPrefix + "header"
	attrSTShards = attrSTPrefix + "shards"
	attrSTKeys   = attrSTPrefix + "keys"

	xattrNameMax = 255      // XATTR_NAME_MAX
	xattrSizeMax = 64 << 10 // XATTR_SIZE_MAX: the largest attribute value
	nameMax      = 255      // NAME_MAX: the longest path component

	importPrefix = ".import-" // temporary directory of an import in progress
	savePrefix   = ".save-"   // temporary entry of a save by the Python client
)

var (
	// errInterrupted is returned once the context is done.
	errInterrupted = errors.New("interrupted")
	// errFull is wrapped by the error for a mount with no room for a segment.
	errFull = errors.New("the tensorfs mount is full")
)

// room is what a mount had free when an import began, and where to
// look: a directory the import's cleanup leaves in place.
type room struct {
	dir            string
	free, capacity int64
	need           int64 // bytes the import writes
}

// measureRoom reads the free space of the mount holding dir, which exists.
func measureRoom(dir string, need int64) room {
	r := room{dir: dir, free: -1, need: need}
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) == nil {
		r.free, r.capacity = int64(st.Bavail)*st.Bsize, int64(st.Blocks)*st.Bsize
	}
	return r
}

// full is errFull for an import: what it needed, what was free, and where
// to look.
func (r room) full() error {
	had := ""
	if r.free >= 0 {
		had = fmt.Sprintf(" and the mount had %s of %s free when it began", mib(r.free), mib(r.capacity))
	}
	return fmt.Errorf("%w: the import needs %s%s: see df -h %s; free segments or mount with a larger --capacity",
		errFull, mib(r.need), had, r.dir)
}

// mib prints a byte count in MiB, with one decimal.
func mib(n int64) string {
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// Options tune Import and Export, and say what they report as they go.
type Options struct {
	// Progress, if not nil, is called as bytes are copied with the bytes
	// copied so far and the total, from one goroutine at a time.
	Progress func(done, total int64)
	// Warn, if not nil, receives one line for each file Export skips.
	Warn func(msg string)
	// MaxShardSize, when not 0, makes Export split the tensors afresh
	// into shards of at most this many bytes (safetensors.Split).
	MaxShardSize int64
	// Tied names tensors Export leaves out, without a metadata entry,
	// because each shares its segment with a name that is written (a
	// model's tied weights, which save_pretrained drops so).
	Tied []string
	// PackBelow, when > 0, makes Import write each tensor of fewer bytes
	// that is tied to no other name and whose dtype has whole bytes into
	// the directory's pack (PackName) instead of a segment of its own.
	PackBelow int64
}

// Summary says what an import or an export moved.
type Summary struct {
	Tensors int   // tensors with bytes of their own
	Links   int   // further names of a tensor's segment (ties)
	Files   int   // safetensors files read or written
	Bytes   int64 // bytes of the tensors
}

// shardsRecord is what an import of a sharded checkpoint records on the
// directory (user.safetensors.shards, JSON) so that export writes the
// same files back.
type shardsRecord struct {
	Index    string                     `json:"index"`    // the index file's name
	Metadata map[string]json.RawMessage `json:"metadata"` // the index's metadata, null when it had none
	// Raw is the index file's bytes when safetensors.Index.Encode would
	// not give them back.
	Raw   string       `json:"raw,omitempty"`
	Files []fileRecord `json:"files"`
}

// fileRecord is one shard of a shardsRecord.
type fileRecord struct {
	Name     string            `json:"name"`
	Tensors  []string          `json:"tensors"`  // in header order
	Metadata map[string]string `json:"metadata"` // its __metadata__, null when it had none
	// Header is its header when export would not rebuild it.
	Header string `json:"header,omitempty"`
}

// commonMetadata is the directory's metadata (user.safetensors.meta.*)
// of a sharded import: the index's string values, and the entries every
// shard has with the same value.
func (r *shardsRecord) commonMetadata() map[string]string {
	meta := indexStrings(r.Metadata)
	for k, v := range r.Files[0].Metadata {
		same := true
		for _, f := range r.Files[1:] {
			if w, ok := f.Metadata[k]; !ok || w != v {
				same = false
			}
		}
		if same {
			meta[k] = v
		}
	}
	return meta
}

// interrupted returns errInterrupted once ctx is done.
func interrupted(ctx context.Context) error {
	if ctx.Err() != nil {
		return errInterrupted
	}
	return nil
}
