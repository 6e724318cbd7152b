package ctl

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"syscall"
	"unicode/utf8"
)

// Protocol constants; doc.go states them for client writers.
const (
	version       = 1
	maxMessage    = 64 << 10 // bytes in one request or reply
	maxPath       = 4096     // bytes in a path
	maxGroup      = 256      // bytes in a group name
	maxWorld      = 253      // SCM_MAX_FD: an all_gather reply carries world fds
	maxRequestFDs = 16       // descriptors the daemon receives on one message
	maxErrorText  = 8 << 10  // bytes of "error" in a reply
)

// Ops.
const (
	opExport    = "export"
	opImport    = "import"
	opAllGather = "all_gather"
	opBroadcast = "broadcast"
	opLoad      = "load"
	opPurge     = "purge"
	opPublish   = "publish"
	opPull      = "pull"
	opUnpublish = "unpublish"
)

// A request is a decoded, validated request message.
type request struct {
	Op    string
	Path  string // cleaned (export, import)
	Write bool   // export
	Dtype string // import
	Shape string // import
	Group string // all_gather, broadcast
	Rank  int    // all_gather, broadcast
	World int    // all_gather, broadcast
	Root  int    // broadcast
	Open  bool   // all_gather, broadcast: the group is open to every uid
	After string // load: resume after this segment name
}

// A memberSpec is a member a request may carry besides "v" and "op".
type memberSpec struct {
	name     string
	required bool
}

// opMembers lists the members each op takes.
var opMembers = map[string][]memberSpec{
	opExport:    {{"path", true}, {"write", false}},
	opImport:    {{"path", true}, {"dtype", false}, {"shape", false}},
	opAllGather: {{"group", true}, {"rank", true}, {"world", true}, {"open", false}},
	opBroadcast: {{"group", true}, {"rank", true}, {"world", true}, {"root", true}, {"open", false}},
	opLoad:      {{"path", true}, {"write", false}, {"after", false}},
	opPurge:     {},
	opPublish:   {{"path", true}},
	opPull:      {{"path", true}},
	opUnpublish: {{"path", true}},
}

// wantFDs is the number of descriptors a valid request carries.
func (r *request) wantFDs() int {
	switch {
	case r.Op == opImport, r.Op == opAllGather:
		return 1
	case r.Op == opBroadcast && r.Rank == r.Root:
		return 1
	}
	return 0
}

// protoErr is a refusal decided by ctl itself, sent back as errno and text.
type protoErr struct {
	errno syscall.Errno
	msg   string
}

func (e *protoErr) Error() string { return e.msg }

// protoErrorf returns a *protoErr with errno and a formatted reason.
func protoErrorf(errno syscall.Errno, format string, args ...any) error {
	return &protoErr{errno: errno, msg: fmt.Sprintf(format, args...)}
}

// parseRequest decodes and validates one request message that came with
// nfds descriptors. Errors are *protoErr.
func parseRequest(b []byte, nfds int) (request, error) {
	var r request
	if len(b) > maxMessage {
		return r, protoErrorf(syscall.EMSGSIZE, "request of %d bytes exceeds %d", len(b), maxMessage)
	}
	if !utf8.Valid(b) {
		// encoding/json would turn bad bytes into U+FFFD, which could
		// name a real segment.
		return r, protoErrorf(syscall.EINVAL, "request is not valid UTF-8")
	}
	members, order, err := decodeObject(b)
	if err != nil {
		return r, protoErrorf(syscall.EINVAL, "request is not a JSON object: %v", err)
	}
	var v int
	if err := decodeMember(members, "v", &v); err != nil {
		return r, err
	}
	if v != version {
		return r, protoErrorf(syscall.EPROTONOSUPPORT, "protocol version %d not supported (want %d)", v, version)
	}
	if err := decodeMember(members, "op", &r.Op); err != nil {
		return r, err
	}
	allowed, ok := opMembers[r.Op]
	if !ok {
		return r, protoErrorf(syscall.EOPNOTSUPP, "unknown op %q", r.Op)
	}
	for _, name := range order {
		if name != "v" && name != "op" && !slices.ContainsFunc(allowed, func(m memberSpec) bool { return m.name == name }) {
			return r, protoErrorf(syscall.EINVAL, "member %q not valid for op %s", name, r.Op)
		}
	}
	for _, spec := range allowed {
		name := spec.name
		if _, ok := members[name]; !ok {
			if spec.required {
				return r, protoErrorf(syscall.EINVAL, "op %s needs member %q", r.Op, name)
			}
			continue
		}
		var err error
		switch name {
		case "path":
			err = decodeMember(members, name, &r.Path)
		case "write":
			err = decodeMember(members, name, &r.Write)
		case "dtype":
			err = decodeMember(members, name, &r.Dtype)
		case "shape":
			err = decodeMember(members, name, &r.Shape)
		case "group":
			err = decodeMember(members, name, &r.Group)
		case "rank":
			err = decodeMember(members, name, &r.Rank)
		case "world":
			err = decodeMember(members, name, &r.World)
		case "root":
			err = decodeMember(members, name, &r.Root)
		case "open":
			err = decodeMember(members, name, &r.Open)
		case "after":
			err = decodeMember(members, name, &r.After)
		}
		if err != nil {
			return r, err
		}
	}
	switch r.Op {
	case opExport, opImport, opPublish, opPull, opUnpublish:
		if r.Path, err = cleanPath(r.Path); err != nil {
			return r, err
		}
	case opLoad:
		if r.Path, err = cleanDir(r.Path); err != nil {
			return r, err
		}
		if len(r.After) > maxPath || strings.IndexByte(r.After, 0) >= 0 {
			return r, protoErrorf(syscall.EINVAL, "after: a segment name of at most %d bytes, no NUL", maxPath)
		}
	case opAllGather, opBroadcast:
		if err := checkGroup(&r); err != nil {
			return r, err
		}
	}
	if want := r.wantFDs(); nfds != want {
		return r, protoErrorf(syscall.EINVAL, "op %s takes %d descriptors, got %d", r.Op, want, nfds)
	}
	return r, nil
}

// decodeObject splits a JSON object into its members, also returning their
// names in order, and refuses duplicate names and anything after the
// object.
func decodeObject(b []byte) (map[string]json.RawMessage, []string, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	tok, err := dec.Token()
	if err != nil {
		return nil, nil, err
	}
	if tok != json.Delim('{') {
		return nil, nil, errors.New("not an object")
	}
	members := make(map[string]json.RawMessage)
	var order []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		name, _ := tok.(string) // the decoder only yields strings here
		if _, dup := members[name]; dup {
			return nil, nil, fmt.Errorf("duplicate member %q", name)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, nil, err
		}
		members[name] = raw
		order = append(order, name)
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return nil, nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, nil, errors.New("data after the object")
	}
	return members, order, nil
}

// decodeMember decodes the required member name into v, whose type is the
// member's JSON type. null is refused.
func decodeMember(members map[string]json.RawMessage, name string, v any) error {
	raw, ok := members[name]
	if !ok {
		return protoErrorf(syscall.EINVAL, "missing member %q", name)
	}
	if string(raw) == "null" {
		return protoErrorf(syscall.EINVAL, "member %q is null", name)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return protoErrorf(syscall.EINVAL, "member %q: want %T: %s", name, v, raw)
	}
	return nil
}

// cleanPath validates a segment path and returns it cleaned.
func cleanPath(p string) (string, error) {
	switch {
	case p == "":
		return "", protoErrorf(syscall.EINVAL, "empty path")
	case len(p) > maxPath:
		return "", protoErrorf(syscall.ENAMETOOLONG, "path of %d bytes exceeds %d", len(p), maxPath)
	case strings.IndexByte(p, 0) >= 0:
		return "", protoErrorf(syscall.EINVAL, "path contains a NUL byte")
	case p[0] == '/':
		return "", protoErrorf(syscall.EINVAL, "path %q is absolute", p)
	}
	for elem := range strings.SplitSeq(p, "/") {
		if elem == ".." {
			return "", protoErrorf(syscall.EINVAL, "path %q has a \"..\" component", p)
		}
	}
	c := path.Clean(p)
	if c == "." {
		return "", protoErrorf(syscall.EINVAL, "path %q names the mount root", p)
	}
	return c, nil
}

// cleanDir validates a directory path as cleanPath does, except that the
// mount root ("." or "./") is allowed.
func cleanDir(p string) (string, error) {
	if p == "." || p == "./" {
		return ".", nil
	}
	return cleanPath(p)
}

// checkGroup validates the group members of an all_gather or broadcast.
func checkGroup(r *request) error {
	switch {
	case r.Group == "" || len(r.Group) > maxGroup:
		return protoErrorf(syscall.EINVAL, "group name of %d bytes: want 1 to %d", len(r.Group), maxGroup)
	case strings.IndexByte(r.Group, 0) >= 0:
		return protoErrorf(syscall.EINVAL, "group name contains a NUL byte")
	case r.World < 1 || r.World > maxWorld:
		return protoErrorf(syscall.EINVAL, "world %d: want 1 to %d", r.World, maxWorld)
	case r.Rank < 0 || r.Rank >= r.World:
		return protoErrorf(syscall.EINVAL, "rank %d outside world %d", r.Rank, r.World)
	case r.Op == opBroadcast && (r.Root < 0 || r.Root >= r.World):
		return protoErrorf(syscall.EINVAL, "root %d outside world %d", r.Root, r.World)
	}
	return nil
}

// marshal encodes r as a request message, with only the members its op
// takes.
func (r *request) marshal() ([]byte, error) {
	m := map[string]any{"v": version, "op": r.Op}
	switch r.Op {
	case opExport:
		m["path"] = r.Path
		if r.Write {
			m["write"] = true
		}
	case opPublish, opPull, opUnpublish:
		m["path"] = r.Path
	case opImport:
		m["path"] = r.Path
		if r.Dtype != "" {
			m["dtype"] = r.Dtype
		}
		if r.Shape != "" {
			m["shape"] = r.Shape
		}
	case opLoad:
		m["path"] = r.Path
		if r.Write {
			m["write"] = true
		}
		if r.After != "" {
			m["after"] = r.After
		}
	case opBroadcast:
		m["root"] = r.Root
		fallthrough
	case opAllGather:
		m["group"] = r.Group
		m["rank"] = r.Rank
		m["world"] = r.World
		if r.Open {
			m["open"] = true
		}
	}
	return json.Marshal(m)
}

// reply is a reply message.
type reply struct {
	V        int       `json:"v"`
	OK       bool      `json:"ok"`
	FDs      int       `json:"fds,omitempty"`
	Errno    int       `json:"errno,omitempty"`
	Error    string    `json:"error,omitempty"`
	Segments []Segment `json:"segments,omitempty"` // load
	More     bool      `json:"more,omitempty"`     // load: segments follow the last one
	Version  string    `json:"version,omitempty"`  // publish: the version made
	Bytes    int64     `json:"bytes,omitempty"`    // pull: the bytes pulled
}

// A Segment is one segment of a load reply: its name relative to the
// directory asked for ('/'-separated), size in bytes, flags and tensor
// attributes (canonical spellings, "" when unset), and FD, the index of
// its descriptor among the reply's, or -1 where none is handed out.
type Segment struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	FD     int    `json:"fd"`
	Flags  string `json:"flags,omitempty"`
	Dtype  string `json:"dtype,omitempty"`
	Shape  string `json:"shape,omitempty"`
	Stride string `json:"stride,omitempty"`
	Offset string `json:"offset,omitempty"`
	Links  uint64 `json:"links,omitempty"` // names of the segment's inode when listed
}

// errorReply is the reply refusing a request with errno and reason msg.
func errorReply(errno syscall.Errno, msg string) reply {
	if len(msg) > maxErrorText {
		msg = strings.ToValidUTF8(msg[:maxErrorText], "")
	}
	return reply{V: version, Errno: int(errno), Error: msg}
}

// parseReply decodes a reply message that came with nfds descriptors.
func parseReply(b []byte, nfds int) (reply, error) {
	var r reply
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("malformed reply: %w", err)
	}
	switch {
	case r.V != version:
		return r, fmt.Errorf("reply has protocol version %d, want %d", r.V, version)
	case !r.OK && r.Errno <= 0:
		return r, fmt.Errorf("error reply without errno: %q", r.Error)
	case r.FDs != nfds:
		return r, fmt.Errorf("reply announces %d descriptors, %d attached", r.FDs, nfds)
	}
	return r, nil
}

// RemoteError is a refusal from the daemon. It unwraps to its Errno, so
// errors.Is(err, syscall.EPERM) and errors.Is(err, fs.ErrNotExist) work.
type RemoteError struct {
	// Op is the request's op: export, import, load, all_gather, broadcast,
	// purge, publish or pull.
	Op string
	// Errno is the errno the daemon answered.
	Errno syscall.Errno
	// Msg is the daemon's reason.
	Msg string
}

// Error describes the refusal.
func (e *RemoteError) Error() string {
	return fmt.Sprintf("tensorfs ctl %s: %s: %v", e.Op, e.Msg, e.Errno)
}

// Unwrap returns e.Errno.
func (e *RemoteError) Unwrap() error { return e.Errno }
