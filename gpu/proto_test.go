package gpu

import (
	"errors"
	"fmt"
	"testing"
)

func TestProtoRoundTrip(t *testing.T) {
	m := &message{op: opCopyIn, id: 0xdeadbeef, args: []int64{1, -2, 1 << 62}, data: []byte("data")}
	got, err := unmarshal(m.marshal())
	if err != nil || got.op != m.op || got.id != m.id || fmt.Sprint(got.args) != fmt.Sprint(m.args) || string(got.data) != "data" {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	for _, b := range [][]byte{nil, {protoVersion, 1, 0, 3, 0, 0, 0, 0}, {protoVersion + 1, 1, 0, 0, 0, 0, 0, 0}} {
		if _, err := unmarshal(b); !errors.Is(err, errProtocol) {
			t.Errorf("unmarshal(%v) = %v, want errProtocol", b, err)
		}
	}
	for _, sentinel := range wireErrors[1:] {
		r := &message{}
		r.setError(fmt.Errorf("wrapped: %w", sentinel))
		got, _ := unmarshal(r.marshal())
		if err := got.err(); !errors.Is(err, sentinel) || err.Error() != "wrapped: "+sentinel.Error() {
			t.Errorf("error %v came back as %v", sentinel, err)
		}
	}
	r := &message{}
	r.setError(errors.New("plain"))
	if err := r.err(); err == nil || err.Error() != "plain" {
		t.Errorf("plain error came back as %v", err)
	}
}
