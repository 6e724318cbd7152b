// Package piecepb is the generated gRPC code of pieces.proto, the piece
// service of the cluster transport.
package piecepb

// Regenerate with protoc (Debian protobuf-compiler), protoc-gen-go and
// protoc-gen-go-grpc on PATH:
//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative pieces.proto
