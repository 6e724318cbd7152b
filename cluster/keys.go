package cluster

import (
	"fmt"
	"strings"
)

// DefaultPrefix is the key prefix of a cluster (Config.Prefix).
const DefaultPrefix = "/tensorfs/"

// keys builds the etcd keys of the layout in doc.go.
type keys struct{ prefix string }

func (k keys) nodes() string                  { return k.prefix + "nodes/" }
func (k keys) node(name string) string        { return k.nodes() + name }
func (k keys) dirs() string                   { return k.prefix + "dirs/" }
func (k keys) dir(dir string) string          { return k.dirs() + dir }
func (k keys) versions() string               { return k.prefix + "versions/" }
func (k keys) version(vid string) string      { return k.versions() + vid }
func (k keys) entries(vid string) string      { return k.prefix + "entries/" + vid + "/" }
func (k keys) entry(vid, p string) string     { return k.entries(vid) + p }
func (k keys) content(cid string) string      { return k.prefix + "contents/" + cid }
func (k keys) refs(cid string) string         { return k.prefix + "refs/" + cid + "/" }
func (k keys) ref(cid, vid string) string     { return k.refs(cid) + vid }
func (k keys) holders(cid string) string      { return k.prefix + "holders/" + cid + "/" }
func (k keys) holder(cid, node string) string { return k.holders(cid) + node }

// checkPrefix checks a key prefix: absolute, ending in "/".
func checkPrefix(p string) error {
	if !strings.HasPrefix(p, "/") || !strings.HasSuffix(p, "/") || strings.IndexByte(p, 0) >= 0 {
		return fmt.Errorf("%w: key prefix %q: want an absolute path ending in /", ErrInvalid, p)
	}
	return nil
}

// checkNodeName checks a node name: what a certificate can carry as a DNS
// name (lower-case letters, digits, '-' and '.', at most 63 bytes, a letter
// or digit at each end).
func checkNodeName(name string) error {
	ok := len(name) > 0 && len(name) <= 63
	for i := 0; ok && i < len(name); i++ {
		c := name[i]
		alnum := 'a' <= c && c <= 'z' || '0' <= c && c <= '9'
		ok = alnum || (c == '-' || c == '.') && i > 0 && i < len(name)-1
	}
	if !ok {
		return fmt.Errorf("%w: node name %q: want lower-case letters, digits, '-' and '.', at most 63, starting and ending with a letter or digit", ErrInvalid, name)
	}
	return nil
}
