package transport

import (
	"sync"

	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"tensorfs/cluster/transport/piecepb"
)

// pieceCodec is gRPC's proto codec, with a chunk's bytes moved without
// protobuf's copies: sent from the piece's own buffer after a header of
// a few bytes, not copied into a marshalled message; received (into a
// chunk, as GRPC.Fetch asks) by one copy out of gRPC's buffers into a
// pooled buffer, not two copies into new memory that the garbage
// collector then reclaims. The bytes on the wire are protobuf's: peers of
// either codec talk.
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

// Unmarshal decodes data into v; into a chunk, a Chunk's data field is
// copied out of gRPC's buffers into one of chunkBufs, which the chunk
// then holds.
func (pieceCodec) Unmarshal(data mem.BufferSlice, v any) error {
	c, ok := v.(*chunk)
	if !ok {
		return protoCodec.Unmarshal(data, v)
	}
	n := data.Len()
	if n > chunkBufSize {
		var m piecepb.Chunk
		err := proto.Unmarshal(data.Materialize(), &m)
		c.data = m.Data
		return err
	}
	c.buf = chunkBufs.Get().(*[]byte)
	b := (*c.buf)[:n]
	data.CopyTo(b)
	if num, typ, h := protowire.ConsumeTag(b); h > 0 && num == 1 && typ == protowire.BytesType {
		if d, m := protowire.ConsumeBytes(b[h:]); m >= 0 && h+m == n {
			c.data = d
			return nil
		}
	}
	var m piecepb.Chunk // not the one data field alone: protobuf's answer
	err := proto.Unmarshal(b, &m)
	c.data = m.Data
	return err
}

// chunk is a received piecepb.Chunk: its data, in buf (from chunkBufs)
// unless nil.
type chunk struct {
	data []byte
	buf  *[]byte
}

// free gives the chunk's buffer back to chunkBufs: its data is no more.
func (c *chunk) free() {
	if c.buf != nil {
		chunkBufs.Put(c.buf)
	}
	*c = chunk{}
}

// chunkBufSize is the largest message a pooled buffer takes: a chunk of
// ChunkSize and its header.
const chunkBufSize = ChunkSize + 16

// chunkBufs are the buffers received chunks are copied into.
var chunkBufs = sync.Pool{New: func() any {
	b := make([]byte, chunkBufSize)
	return &b
}}

// Name is proto's: the content type on the wire is unchanged.
func (pieceCodec) Name() string { return grpcproto.Name }
