package safetensors

// Sharded checkpoints, as Hugging Face writes them: the tensors spread over
// files named PREFIX-00001-of-0000N.safetensors, and an index,
// PREFIX.safetensors.index.json, saying which file holds each tensor:
//
//	{
//	  "metadata": {
//	    "total_size": 1234
//	  },
//	  "weight_map": {
//	    "lm_head.weight": "model-00001-of-00002.safetensors",
//	    ...
//	  }
//	}
//
// transformers' save_pretrained writes the index with Python's
// json.dumps(index, indent=2, sort_keys=True) and a newline; the files are
// split by huggingface_hub's split_torch_state_dict_into_shards (Split).

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// IndexSuffix ends the name of a sharded checkpoint's index file.
const IndexSuffix = ".safetensors.index.json"

// DefaultMaxShardSize is huggingface_hub's default largest shard: "5GB".
const DefaultMaxShardSize = 5_000_000_000

// Index is a sharded checkpoint's index file.
type Index struct {
	// Metadata is the "metadata" object, each value as raw JSON
	// ("total_size" is a number); nil when the index has none.
	Metadata map[string]json.RawMessage
	// WeightMap maps every tensor name to the file that holds it, a
	// plain name in the index's directory.
	WeightMap map[string]string
}

// ParseIndex parses and checks an index file: a JSON object (valid UTF-8,
// at most MaxHeaderSize bytes) whose "weight_map" maps tensor names to
// plain file names (no '/', not "." or "..", no NUL) and whose optional
// "metadata" is an object. Keys may not repeat; other members are
// ignored. Errors wrap ErrInvalid.
func ParseIndex(raw []byte) (*Index, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: bad index: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	if len(raw) > MaxHeaderSize {
		return nil, bad("%d bytes is over the %d-byte limit", len(raw), MaxHeaderSize)
	}
	if !utf8.Valid(raw) {
		return nil, bad("not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, bad("not a JSON object")
	}
	ix := &Index{}
	seen := map[string]bool{}
	for dec.More() {
		key, err := objectKey(dec, seen)
		if err != nil {
			return nil, bad("%v", err)
		}
		switch key {
		case "weight_map":
			ix.WeightMap = map[string]string{}
			err = decodeObject(dec, func(name string) error {
				var file string
				if err := dec.Decode(&file); err != nil {
					return fmt.Errorf("weight_map[%q] is not a string", name)
				}
				if err := checkFileName(file); err != nil {
					return fmt.Errorf("weight_map[%q]: %v", name, err)
				}
				if name == "" || name == MetadataKey {
					return fmt.Errorf("%q is not a tensor name", name)
				}
				ix.WeightMap[name] = file
				return nil
			})
		case "metadata":
			ix.Metadata = map[string]json.RawMessage{}
			err = decodeObject(dec, func(k string) error {
				var v json.RawMessage
				if err := dec.Decode(&v); err != nil {
					return err
				}
				ix.Metadata[k] = v
				return nil
			})
		default:
			var skip json.RawMessage
			err = dec.Decode(&skip)
		}
		if err != nil {
			return nil, bad("%s: %v", key, err)
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, bad("unterminated object")
	}
	if len(bytes.Trim(raw[dec.InputOffset():], " \t\r\n")) != 0 {
		return nil, bad("trailing data after the object")
	}
	if ix.WeightMap == nil {
		return nil, bad("no weight_map")
	}
	return ix, nil
}

// objectKey reads the next key of an object and refuses one seen before.
func objectKey(dec *json.Decoder, seen map[string]bool) (string, error) {
	tok, err := dec.Token()
	if err != nil {
		return "", err
	}
	key, ok := tok.(string)
	if !ok {
		return "", fmt.Errorf("object key %v is not a string", tok)
	}
	if seen[key] {
		return "", fmt.Errorf("key %q appears twice", key)
	}
	seen[key] = true
	return key, nil
}

// decodeObject reads an object, calling member for each key with the
// decoder positioned at its value, which member must consume.
func decodeObject(dec *json.Decoder, member func(key string) error) error {
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return fmt.Errorf("not an object")
	}
	seen := map[string]bool{}
	for dec.More() {
		key, err := objectKey(dec, seen)
		if err != nil {
			return err
		}
		if err := member(key); err != nil {
			return err
		}
	}
	_, err := dec.Token()
	return err
}

// checkFileName refuses a shard name that is not a plain file name.
func checkFileName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("%q is not a file name", name)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("file name %q contains '/' or NUL", name)
	case len(name) > 255:
		return fmt.Errorf("file name %.40q... is over 255 bytes", name)
	}
	return nil
}

// Files returns the distinct files of the weight map, sorted (the order
// of their names, 00001 first).
func (ix *Index) Files() []string {
	var files []string
	for _, f := range ix.WeightMap {
		files = append(files, f)
	}
	slices.Sort(files)
	return slices.Compact(files)
}

// Encode returns the index as transformers' save_pretrained writes it:
// Python's json.dumps(index, indent=2, sort_keys=True) and a newline,
// "metadata" (when not nil) then "weight_map". Metadata values are
// re-indented the same way; numbers keep their JSON text.
func (ix *Index) Encode() []byte {
	top := map[string]any{}
	if ix.Metadata != nil {
		meta := map[string]any{}
		for k, raw := range ix.Metadata {
			dec := json.NewDecoder(bytes.NewReader(raw))
			dec.UseNumber()
			var v any
			if err := dec.Decode(&v); err != nil {
				v = string(raw) // not JSON: kept as its text
			}
			meta[k] = v
		}
		top["metadata"] = meta
	}
	wm := make(map[string]any, len(ix.WeightMap))
	for k, f := range ix.WeightMap {
		wm[k] = f
	}
	top["weight_map"] = wm
	return append(appendPyJSON(nil, top, 0), '\n')
}

// appendPyJSON appends v (nil, bool, json.Number, string, []any or
// map[string]any) as Python's json.dumps(v, indent=2, sort_keys=True)
// writes it at the given depth of indentation.
func appendPyJSON(b []byte, v any, depth int) []byte {
	pad := func(b []byte, n int) []byte {
		b = append(b, '\n')
		return append(b, strings.Repeat("  ", n)...)
	}
	switch v := v.(type) {
	case nil:
		return append(b, "null"...)
	case bool:
		return strconv.AppendBool(b, v)
	case json.Number:
		return append(b, v...)
	case string:
		return appendPyString(b, v)
	case []any:
		if len(v) == 0 {
			return append(b, "[]"...)
		}
		b = append(b, '[')
		for i, e := range v {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendPyJSON(pad(b, depth+1), e, depth+1)
		}
		return append(pad(b, depth), ']')
	case map[string]any:
		if len(v) == 0 {
			return append(b, "{}"...)
		}
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.Sort(keys) // byte order of UTF-8 is code point order, as Python sorts
		b = append(b, '{')
		for i, k := range keys {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendPyString(pad(b, depth+1), k)
			b = append(b, ':', ' ')
			b = appendPyJSON(b, v[k], depth+1)
		}
		return append(pad(b, depth), '}')
	}
	panic(fmt.Sprintf("appendPyJSON: %T", v))
}

// appendPyString appends s as Python's json.dumps writes it with
// ensure_ascii: printable ASCII as itself, '"' and '\\' escaped, \n \r \t
// \b \f, and every other character as \uXXXX (lower-case hex, UTF-16
// surrogate pairs past U+FFFF).
func appendPyString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	u := func(b []byte, r rune) []byte {
		return append(b, '\\', 'u', hex[r>>12&0xf], hex[r>>8&0xf], hex[r>>4&0xf], hex[r&0xf])
	}
	b = append(b, '"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b = append(b, '\\', byte(r))
		case r == '\n':
			b = append(b, '\\', 'n')
		case r == '\r':
			b = append(b, '\\', 'r')
		case r == '\t':
			b = append(b, '\\', 't')
		case r == '\b':
			b = append(b, '\\', 'b')
		case r == '\f':
			b = append(b, '\\', 'f')
		case r >= ' ' && r <= '~':
			b = append(b, byte(r))
		case r > 0xffff:
			r1, r2 := utf16.EncodeRune(r)
			b = u(u(b, r1), r2)
		default:
			b = u(b, r)
		}
	}
	return append(b, '"')
}

// ShardName returns the name of shard i (from 0) of n of a checkpoint
// whose single file would be PREFIX.safetensors:
// PREFIX-00001-of-00003.safetensors, or PREFIX.safetensors when n is 1.
func ShardName(prefix string, i, n int) string {
	if n == 1 {
		return prefix + ".safetensors"
	}
	return fmt.Sprintf("%s-%05d-of-%05d.safetensors", prefix, i+1, n)
}

// Split assigns tensors of the given byte sizes, in order, to shards of
// at most maxSize bytes, as huggingface_hub's
// split_torch_state_dict_into_shards does: a tensor that would take the
// current shard past maxSize starts a new one, and a tensor larger than
// maxSize gets a shard of its own at once, the current shard staying
// open behind it. It returns the indexes of the tensors of each shard.
func Split(sizes []int64, maxSize int64) [][]int {
	var shards [][]int
	var cur []int
	var curSize int64
	for i, n := range sizes {
		if n > maxSize {
			shards = append(shards, []int{i})
			continue
		}
		if curSize+n > maxSize && len(cur) > 0 {
			shards = append(shards, cur)
			cur, curSize = nil, 0
		}
		cur = append(cur, i)
		curSize += n
	}
	if len(cur) > 0 {
		shards = append(shards, cur)
	}
	return shards
}

// ParseShardSize reads a largest shard size as huggingface_hub's
// parse_size_to_int does: a number and a unit of TB, GB, MB or KB (powers
// of 1000, case-insensitive), "5GB" or "1.5 GB"; or a plain number of
// bytes. tensorfs reads its other sizes in bytes (import's --pack-below)
// the same way.
func ParseShardSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		if n <= 0 {
			return 0, fmt.Errorf("size %q is not positive", s)
		}
		return n, nil
	}
	units := map[string]float64{"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3}
	var mult float64
	if len(s) >= 3 {
		mult = units[strings.ToUpper(s[len(s)-2:])]
	}
	if mult == 0 {
		return 0, fmt.Errorf("size %q: want a number of bytes, or a number and TB, GB, MB or KB (powers of 1000, "+
			"as huggingface_hub reads them: 5GB, 500KB)", s)
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(s[:len(s)-2]), 64)
	if err != nil || v*mult < 1 || v*mult > math.MaxInt64/2 {
		return 0, fmt.Errorf("%q is not a positive size", s)
	}
	return int64(v * mult), nil
}
