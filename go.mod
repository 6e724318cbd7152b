module tensorfs

go 1.26.8

require (
	github.com/google/uuid v1.1.1 // indirect
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	golang.org/x/sys v0.49.0 // indirect
	gorgonia.org/cu v0.9.6
)
