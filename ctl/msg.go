package ctl

import (
	"encoding/json"
	"net"

	"tensorfs/fdpass"
)

// A message is one received request message.
type message struct {
	fdpass.Msg
	// err refuses the message before it is parsed: its descriptors were
	// over a limit and are closed.
	err error
}

// recvMsg reads one message of up to maxMessage bytes with room for
// maxFDs descriptors (see fdpass.Recv).
func recvMsg(c *net.UnixConn, maxFDs int) (fdpass.Msg, error) {
	return fdpass.Recv(c, maxMessage, maxFDs)
}

// sendReply sends r with fds attached.
func sendReply(c *net.UnixConn, r reply, fds []int) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return fdpass.Send(c, b, fds...)
}
