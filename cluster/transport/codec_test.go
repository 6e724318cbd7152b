package transport

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"tensorfs/cluster/transport/piecepb"
)

// TestPieceCodec: chunks pass through pieceCodec as protobuf's bytes on
// the wire (what proto.Marshal writes, and what proto.Unmarshal reads),
// an empty one too; a chunk of two data fields is decoded as protobuf
// decodes it; other messages are proto's.
func TestPieceCodec(t *testing.T) {
	for _, data := range [][]byte{nil, {1}, randomBytes(t, 300<<10)} {
		in := &piecepb.Chunk{Data: data}
		wire, err := pieceCodec{}.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := proto.Marshal(in)
		if got := wire.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("a chunk of %d bytes encodes to %d bytes, not protobuf's %d", len(data), len(got), len(want))
		}
		var out chunk
		if err := (pieceCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(want)}, &out); err != nil || !bytes.Equal(out.data, data) {
			t.Fatalf("decoding a chunk of %d bytes: %d bytes, %v", len(data), len(out.data), err)
		}
		out.free()
	}
	// data, then data again (the last one wins in protobuf).
	two := append(mustMarshal(t, &piecepb.Chunk{Data: []byte("first")}), mustMarshal(t, &piecepb.Chunk{Data: []byte("second")})...)
	var out chunk
	if err := (pieceCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(two)}, &out); err != nil || string(out.data) != "second" {
		t.Fatalf("a chunk of two data fields: %q, %v; want protobuf's answer", out.data, err)
	}
	req := &piecepb.FetchRequest{Content: "c1", Index: 7}
	wire, err := pieceCodec{}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	got := &piecepb.FetchRequest{}
	if err := (pieceCodec{}).Unmarshal(wire, got); err != nil || !proto.Equal(got, req) {
		t.Fatalf("a fetch request through the codec: %v, %v", got, err)
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
