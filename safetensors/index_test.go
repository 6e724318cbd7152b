package safetensors

import (
	"encoding/json"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
)

// pyIndex is what Python 3's json.dumps(index, indent=2, sort_keys=True)
// + "\n" writes (transformers' save_pretrained) for the index of
// TestIndexEncode, printed by /usr/bin/python3.
const pyIndex = "{\n  \"metadata\": {\n    \"nested\": {\n      \"a\": {},\n      \"b\": [\n        1,\n        2.5,\n        true,\n        null,\n        []\n      ]\n    },\n    \"note\": \"\\u00e9\\u2028\\u007f<\\\"\\\\/\\ud83d\\ude00\",\n    \"total_size\": 1234\n  },\n  \"weight_map\": {\n    \"a.w\": \"model-00001-of-00002.safetensors\",\n    \"b.w\": \"model-00002-of-00002.safetensors\",\n    \"\\u00e4\": \"model-00001-of-00002.safetensors\"\n  }\n}\n"

func TestIndexEncode(t *testing.T) {
	// The same index, compact and with its keys in another order.
	raw := `{"weight_map":{"b.w":"model-00002-of-00002.safetensors","a.w":"model-00001-of-00002.safetensors","ä":"model-00001-of-00002.safetensors"},` +
		`"metadata":{"total_size":1234,"note":"é` + "\u2028\x7f" + `<\"\\/😀","nested":{"b":[1,2.5,true,null,[]],"a":{}}}}`
	ix, err := ParseIndex([]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(ix.Encode()); got != pyIndex {
		t.Errorf("Encode =\n%s\nwant (Python's json.dumps)\n%s", got, pyIndex)
	}
	back, err := ParseIndex([]byte(pyIndex))
	if err != nil || !maps.Equal(back.WeightMap, ix.WeightMap) {
		t.Errorf("ParseIndex(Encode()) = %v, %v", back, err)
	}
	if got := ix.Files(); !slices.Equal(got, []string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
		t.Errorf("Files = %q", got)
	}
}

func TestParseIndexRefused(t *testing.T) {
	for _, c := range []struct{ raw, mention string }{
		{`[]`, "not a JSON object"},
		{`{"metadata": {}}`, "no weight_map"},
		{`{"weight_map": {"a": 1}}`, "not a string"},
		{`{"weight_map": {"a": "../x.safetensors"}}`, "'/'"},
		{`{"weight_map": {"a": ".."}}`, "not a file name"},
		{`{"weight_map": {"__metadata__": "x"}}`, "not a tensor name"},
		{`{"weight_map": {"a": "x", "a": "y"}}`, "twice"},
		{`{"weight_map": {}, "weight_map": {}}`, "twice"},
		{`{"weight_map": {"a": "x"}} x`, "trailing"},
		{`{"weight_map": {"a": "x"}`, "unterminated"},
		{"{\"weight_map\": {\"a\": \"\xff\"}}", "UTF-8"},
		{`{"weight_map": {"a": "x"}, "metadata": []}`, "not an object"},
	} {
		_, err := ParseIndex([]byte(c.raw))
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("ParseIndex(%s) = %v, want an ErrInvalid mentioning %q", c.raw, err, c.mention)
		}
	}
}

// TestSplit follows huggingface_hub's split_torch_state_dict_into_shards,
// including its docstring's example ([6, 6, 2, 6, 2, 2] GB at 10 GB) and
// a tensor over the limit, which gets a shard of its own at once.
func TestSplit(t *testing.T) {
	for _, c := range []struct {
		sizes []int64
		max   int64
		want  [][]int
	}{
		{[]int64{6, 6, 2, 6, 2, 2}, 10, [][]int{{0}, {1, 2}, {3, 4, 5}}},
		{[]int64{3, 20, 3, 3, 3}, 10, [][]int{{1}, {0, 2, 3}, {4}}},
		{[]int64{1, 2}, 10, [][]int{{0, 1}}},
		{[]int64{0, 10, 0}, 10, [][]int{{0, 1, 2}}},
		{nil, 10, nil},
	} {
		if got := Split(c.sizes, c.max); !slices.EqualFunc(got, c.want, slices.Equal) {
			t.Errorf("Split(%v, %d) = %v, want %v", c.sizes, c.max, got, c.want)
		}
	}
	if got := ShardName("model", 1, 3); got != "model-00002-of-00003.safetensors" {
		t.Errorf("ShardName = %q", got)
	}
	if got := ShardName("model", 0, 1); got != "model.safetensors" {
		t.Errorf("ShardName of one = %q", got)
	}
}

func TestParseShardSize(t *testing.T) {
	for s, want := range map[string]int64{"5GB": 5e9, "1.5 gb": 1.5e9, "200MB": 2e8, "10KB": 1e4, "2TB": 2e12, "4096": 4096} {
		if got, err := ParseShardSize(s); err != nil || got != want {
			t.Errorf("ParseShardSize(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "GB", "5XB", "-1GB", "0", "x MB", "5 GiB"} {
		if _, err := ParseShardSize(s); err == nil {
			t.Errorf("ParseShardSize(%q) accepted", s)
		}
	}
}

// FuzzParseIndex: whatever ParseIndex accepts, Encode writes back as an
// index ParseIndex accepts with the same weight map and metadata keys,
// and Encode of that is the same bytes.
func FuzzParseIndex(f *testing.F) {
	f.Add([]byte(pyIndex))
	f.Add([]byte(`{"weight_map":{"a":"x.safetensors"}}`))
	f.Add([]byte(`{"metadata":{"total_size":1e3,"k":"v"},"weight_map":{},"other":[1]}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		ix, err := ParseIndex(raw)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		enc := ix.Encode()
		back, err := ParseIndex(enc)
		if err != nil {
			t.Fatalf("Encode of an accepted index does not parse: %v\n%s", err, enc)
		}
		if !maps.Equal(back.WeightMap, ix.WeightMap) || !slices.Equal(slices.Sorted(maps.Keys(back.Metadata)), slices.Sorted(maps.Keys(ix.Metadata))) {
			t.Fatalf("round trip changed the index:\n%+v\n%+v", ix, back)
		}
		for k, v := range ix.Metadata {
			var a, b any
			if json.Unmarshal(v, &a) == nil && (json.Unmarshal(back.Metadata[k], &b) != nil || !jsonEqual(a, b)) {
				t.Fatalf("metadata %q: %s became %s", k, v, back.Metadata[k])
			}
		}
		if again := back.Encode(); string(again) != string(enc) {
			t.Fatalf("Encode is not stable:\n%s\n%s", enc, again)
		}
	})
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
