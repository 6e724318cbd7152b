module tensorfs

go 1.26.8

require (
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	golang.org/x/sys v0.49.0 // indirect
)
