package transport

import (
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"tensorfs/cluster/transport/piecepb"
)

// pieceCodec is gRPC's proto codec, with a Chunk's bytes moved without
// protobuf's copies: sent from the piece's own buffer after a header of
// a few bytes, not copied into a marshalled message; received by one
// copy out of gRPC's buffers, which the Chunk's data then is, not two.
// The bytes on the wire are protobuf's: peers of either codec talk.
type pieceCodec struct{}

var _ encoding.CodecV2 = pieceCodec{}

// protoCodec is the codec of every other message.
var protoCodec = encoding.GetCodecV2(grpcproto.Name)

// Marshal encodes v; a Chunk's data is referenced, not copied (the
// server never changes a piece's bytes once it sends them).
func (pieceCodec) Marshal(v any) (mem.BufferSlice, error) {
	c, ok := v.(*piecepb.Chunk)
	if !ok || len(c.Data) == 0 {
		return protoCodec.Marshal(v)
	}
	hdr := protowire.AppendTag(nil, 1, protowire.BytesType)
	hdr = protowire.AppendVarint(hdr, uint64(len(c.Data)))
	return mem.BufferSlice{mem.SliceBuffer(hdr), mem.SliceBuffer(c.Data)}, nil
}

// Unmarshal decodes data into v; a Chunk that is its one data field
// keeps its bytes where they were copied out of gRPC's buffers.
func (pieceCodec) Unmarshal(data mem.BufferSlice, v any) error {
	c, ok := v.(*piecepb.Chunk)
	if !ok {
		return protoCodec.Unmarshal(data, v)
	}
	b := data.Materialize()
	if num, typ, n := protowire.ConsumeTag(b); n > 0 && num == 1 && typ == protowire.BytesType {
		if d, m := protowire.ConsumeBytes(b[n:]); m >= 0 && n+m == len(b) {
			c.Reset()
			c.Data = d
			return nil
		}
	}
	return proto.Unmarshal(b, c)
}

// Name is proto's: the content type on the wire is unchanged.
func (pieceCodec) Name() string { return grpcproto.Name }
