package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// The whole demo, as `make demo` runs it, so that a change elsewhere that
// breaks it fails the suite rather than the first person who tries it.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts PostgreSQL and NATS (skipped with -short)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := newDemo(newPrinter(&out, cancel), options{registrations: 2, wait: 30 * time.Second}).run(ctx)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"0 rows, no event",
		"Outbox-Event-Type:         RegistrationConfirmed",
		"all 2 expected events arrived",
		"(applied once, delivered twice;",
		"idempotency hits: 1",
		"stream OUTBOX: 17 messages (expected 17", // 2 + the group stage's 14 + the duplicate
		"member-a took member-b's partitions over without an operator",
		"each registration credited once across the crash",
		// Issue 27: the group dead-lettered the first stage's events.
		"the 2 registrations of the first stage are mapped in this service's database too",
		"no dead letter: each registration credited once",
		"the slot confirmed every published commit",
		"PostgreSQL stopped, data directory removed",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestConfirmSQL(t *testing.T) {
	dir, err := findSQLDir()
	if err != nil {
		t.Fatal(err)
	}
	q, err := confirmSQL(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"UPDATE registration", "WHERE id = $1", "version = $2", "SELECT $3, id, version", "RETURNING event_id, aggregate_version"} {
		if !strings.Contains(q, want) {
			t.Errorf("query lacks %q:\n%s", want, q)
		}
	}
}
