package router

import (
	"strings"
	"testing"
)

func BenchmarkRoute(b *testing.B) {
	for _, bc := range []struct {
		name string
		cfg  Config
	}{
		{"seed", seedConfig()},
		{"extra_headers", Config{Tables: []TableConfig{{Table: "outbox", Headers: map[string]string{"publish_state": ""}}}}},
		{"cloudevents", Config{Tables: []TableConfig{{Table: "outbox", CloudEvents: CloudEventsConfig{Enabled: true}}}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r := mustNew(b, bc.cfg)
			ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), seedRow())
			b.ReportAllocs()
			b.SetBytes(int64(len(testPayload)))
			for b.Loop() {
				if _, err := r.Route(ins, testCommit); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkDeadLetter(b *testing.B) {
	r := mustNew(b, seedConfig())
	row := seedRow()
	row["payload"] = txt(strings.Repeat("p", 2<<20))
	ins := newInsert(newRelation(1, "public", "outbox", seedColumns...), row)
	_, err := r.Route(ins, testCommit)
	b.ReportAllocs()
	for b.Loop() {
		r.DeadLetter(ins, testCommit, err)
	}
}

func BenchmarkEscapeToken(b *testing.B) {
	for _, bc := range []struct{ name, in string }{
		{"uuid_unchanged", testEventID},
		{"dotted", "order.2026.11.29/42"},
		{"utf8", "Zürich-Straße-日本"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.in)))
			for b.Loop() {
				_ = EscapeToken(bc.in)
			}
		})
	}
}
