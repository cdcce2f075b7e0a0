package provision_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestCheckShape(t *testing.T) {
	base := jetstream.StreamConfig{Name: "S", Retention: jetstream.LimitsPolicy, Discard: jetstream.DiscardOld, MaxMsgs: -1, MaxBytes: -1, MaxMsgsPerSubject: -1}
	for _, tc := range []struct {
		name     string
		edit     func(*jetstream.StreamConfig)
		refused  bool
		warnings int
	}{
		{name: "limits", edit: func(*jetstream.StreamConfig) {}},
		{name: "limits with max_age and max_msgs", edit: func(c *jetstream.StreamConfig) { c.MaxAge, c.MaxMsgs = time.Hour, 10 }},
		{name: "work queue", edit: func(c *jetstream.StreamConfig) { c.Retention = jetstream.WorkQueuePolicy }, refused: true},
		{name: "interest", edit: func(c *jetstream.StreamConfig) { c.Retention = jetstream.InterestPolicy }, refused: true},
		{name: "per subject, discard old", edit: func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject = 5 }, refused: true},
		{name: "per subject, discard new", edit: func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject, c.Discard = 5, jetstream.DiscardNew }, refused: true},
		{name: "per subject, discard new per subject", edit: func(c *jetstream.StreamConfig) {
			c.MaxMsgsPerSubject, c.Discard, c.DiscardNewPerSubject = 5, jetstream.DiscardNew, true
		}, warnings: 1},
		{name: "discard new when full", edit: func(c *jetstream.StreamConfig) { c.MaxMsgs, c.Discard = 100, jetstream.DiscardNew }, warnings: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			tc.edit(&cfg)
			w, err := provision.CheckShape(cfg)
			if got := errors.Is(err, provision.ErrDeletesEvents); got != tc.refused || (err != nil && !got) {
				t.Fatalf("CheckShape: %v, want refused %v", err, tc.refused)
			}
			if len(w) != tc.warnings {
				t.Fatalf("warnings %q, want %d", w, tc.warnings)
			}
		})
	}
}

// Issue 26: an existing stream's retention and per-subject limits were
// never inspected, so a work-queue stream or max_msgs_per_subject with
// discard old deleted stored events that reconcile and cleanup then
// trusted. EnsureStream (setup and run) and CheckStream (the tools, and a
// running relay at any time) refuse them.
func TestEnsureStreamRefusesStreamsThatDeleteEvents(t *testing.T) {
	js, err := jetstream.New(connectNATS(t))
	testenv.Must(t, err, "jetstream")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name string
		edit func(*jetstream.StreamConfig)
	}{
		{"workqueue", func(c *jetstream.StreamConfig) { c.Retention = jetstream.WorkQueuePolicy }},
		{"persubject", func(c *jetstream.StreamConfig) { c.MaxMsgsPerSubject = 1 }},
	} {
		name := testenv.UniqueName("SHAPE" + tc.name)
		cfg := jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.FileStorage}
		tc.edit(&cfg)
		if _, err := js.CreateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
		spec := provision.StreamSpec{Name: name, Subjects: []string{name + ".*.*"}}
		if _, err := provision.EnsureStream(ctx, js, spec, true); !errors.Is(err, provision.ErrDeletesEvents) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: EnsureStream = %v, want ErrDeletesEvents naming the stream", tc.name, err)
		}
		if _, err := provision.CheckStream(ctx, js, name); !errors.Is(err, provision.ErrDeletesEvents) {
			t.Errorf("%s: CheckStream = %v, want ErrDeletesEvents", tc.name, err)
		}
	}
}
