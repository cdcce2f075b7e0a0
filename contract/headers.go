package contract

import "github.com/nats-io/nats.go"

// HeaderField is one header of a message the relay publishes: a name and
// its single value.
type HeaderField struct {
	Name, Value string
}

// Headers are the headers of a message the relay publishes, in the order
// the router sets them, each name at most once. The router hands them on
// as a slice instead of a nats.Header, so that no map is built per event:
// the publisher encodes them through one reusable nats.Header of its own.
type Headers []HeaderField

// Lookup returns the value of the header name (names compare exactly, as
// nats.Header's map index does) and whether it is set.
func (h Headers) Lookup(name string) (string, bool) {
	for i := range h {
		if h[i].Name == name {
			return h[i].Value, true
		}
	}
	return "", false
}

// Get returns the value of the header name, "" when it is not set.
func (h Headers) Get(name string) string {
	v, _ := h.Lookup(name)
	return v
}

// NATS returns the headers as a new nats.Header with one value per name,
// the map nats.go encodes on the wire: for code that needs a map of its
// own (tools, tests, a repair that edits headers).
func (h Headers) NATS() nats.Header {
	m := make(nats.Header, len(h))
	for _, f := range h {
		m[f.Name] = []string{f.Value}
	}
	return m
}
