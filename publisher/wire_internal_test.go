package publisher

import (
	"reflect"
	"testing"

	"github.com/outbox-relay/outbox-relay/contract"
)

// TestWireHeaderFill checks the reused header against Headers.NATS as the
// names change from message to message, and that a message with the
// previous one's names costs no allocation and no map operation.
func TestWireHeaderFill(t *testing.T) {
	a := contract.Headers{{Name: "A", Value: "1"}, {Name: "B", Value: "2"}}
	b := contract.Headers{{Name: "A", Value: "3"}, {Name: "C", Value: "4"}, {Name: "D", Value: "5"}}
	dup := contract.Headers{{Name: "A", Value: "6"}, {Name: "A", Value: "7"}}
	var w wireHeader
	for i, hs := range []contract.Headers{a, a, b, dup, dup, nil, a} {
		got := w.fill(hs)
		if want := hs.NATS(); len(hs) == 0 && got != nil || len(hs) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("fill %d: %v, want %v", i, got, want)
		}
		w.release()
		for _, v := range w.vals {
			if v != "" {
				t.Fatalf("fill %d: release kept %q", i, v)
			}
		}
	}
	w.fill(a)
	if n := testing.AllocsPerRun(100, func() { w.fill(a); w.release() }); n != 0 {
		t.Fatalf("fill with the same names: %.0f allocations", n)
	}
}
