package publisher

import (
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/contract"
)

// wireHeader is the one nats.Header a Run goroutine encodes every message's
// headers through, so that publishing builds no map per message. Only its
// Run goroutine touches it.
//
// Reusing it is safe because nats.go keeps nothing of a message after
// Conn.PublishMsg returns: PublishMsg encodes the header into a new byte
// slice (Msg.headerBytes) and publish copies that, the subject and the data
// into the connection's buffer (natsWriter.appendBufs copies into its
// buffer or, while reconnecting, into its pending buffer) before it
// returns (nats.go v1.55.0). A resend fills it again from the Message.
type wireHeader struct {
	h nats.Header
	// names are the names h holds, in the order of the message that set
	// them, and h[names[i]] is vals[i:i+1]: a message with the same names
	// (every event of a table) only overwrites vals, with no map
	// operation at all.
	names []string
	vals  []string
}

// fill returns hs as a nats.Header for one PublishMsg call; call release
// once it returned. nil headers give a nil map (no header block).
func (w *wireHeader) fill(hs contract.Headers) nats.Header {
	if len(hs) == 0 {
		return nil
	}
	if !w.same(hs) {
		w.rebuild(hs)
		return w.h
	}
	for i := range hs {
		w.vals[i] = hs[i].Value
	}
	return w.h
}

func (w *wireHeader) same(hs contract.Headers) bool {
	if len(hs) != len(w.names) {
		return false
	}
	for i := range hs {
		if hs[i].Name != w.names[i] {
			return false
		}
	}
	return true
}

// rebuild makes h hold exactly hs's names. A name given twice keeps its
// last value, as assigning to a nats.Header would.
func (w *wireHeader) rebuild(hs contract.Headers) {
	if w.h == nil {
		w.h = make(nats.Header, len(hs))
	} else {
		clear(w.h)
	}
	w.names = w.names[:0]
	if cap(w.vals) < len(hs) {
		w.vals = make([]string, len(hs))
	}
	w.vals = w.vals[:len(hs)]
	for i, f := range hs {
		w.names = append(w.names, f.Name)
		w.vals[i] = f.Value
		w.h[f.Name] = w.vals[i : i+1 : i+1]
	}
}

// release drops the message's values, so the header holds no message's
// strings between publishes; the names stay for the next fill.
func (w *wireHeader) release() { clear(w.vals) }

// headerLen is the encoded size of hs as nats.go sends it: "NATS/1.0",
// one line per header, a closing blank line.
func headerLen(hs contract.Headers) int {
	if len(hs) == 0 {
		return 0
	}
	n := len("NATS/1.0\r\n") + len("\r\n")
	for _, f := range hs {
		n += len(f.Name) + len(": ") + len(f.Value) + len("\r\n")
	}
	return n
}
