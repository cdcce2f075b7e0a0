package replication_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/replication"
)

// Options validate their input: Open fails with ErrInvalidOption before it
// connects.
func TestOpenRejectsInvalidOption(t *testing.T) {
	cfg := replication.Config{URL: "postgres://relay@127.0.0.1:1/app", Slot: "s", Publication: "p"}
	if _, err := replication.Open(context.Background(), cfg, nil, replication.WithLogger(nil)); !errors.Is(err, replication.ErrInvalidOption) {
		t.Fatalf("Open = %v, want ErrInvalidOption", err)
	}
}

// The limits the configuration file checks are replication's own.
func TestLimits(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"outbox_relay", true}, {"_x9", true}, {"9x", false}, {"Outbox", false}, {"", false},
		{"a23456789012345678901234567890123456789012345678901234567890123", true},
		{"a234567890123456789012345678901234567890123456789012345678901234", false},
	} {
		if got := replication.ValidName(tc.name); got != tc.ok {
			t.Errorf("ValidName(%q) = %v, want %v", tc.name, got, tc.ok)
		}
	}
	if got := replication.MinReceiveTimeout(replication.DefaultStatusInterval); got != 3*time.Second || replication.DefaultReceiveTimeout < got {
		t.Fatalf("MinReceiveTimeout(default) = %s, default receive timeout %s", got, replication.DefaultReceiveTimeout)
	}
}
