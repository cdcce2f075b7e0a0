package relay_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Regression (issue 25): a stream edited under the running relay so that
// it breaks the contract (here its subjects no longer cover the subject
// template) was noticed only at the next start. The start-time check now
// runs every publication check interval: the relay turns not ready naming
// the problem, and ready again once the stream is fixed.
func TestRelayNoticesStreamEdits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	var ready atomic.Bool
	rl, _ := f.Start(ctx, relay.WithReadiness(ready.Store))
	if !testenv.WaitFor(30*time.Second, ready.Load) {
		t.Fatal("never ready")
	}
	s, err := f.JS.Stream(ctx, f.Stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	good := cfg.Subjects
	cfg.Subjects = []string{"elsewhere.>"}
	if _, err := f.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(10*time.Second, func() bool { return !ready.Load() }) {
		t.Fatal("still ready with a stream that no longer covers the subject template")
	}
	if p := rl.StreamProblem(); p == nil || !strings.Contains(p.Error(), "do not cover") {
		t.Fatalf("stream problem %v", p)
	}
	cfg.Subjects = good
	if _, err := f.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(10*time.Second, ready.Load) || rl.StreamProblem() != nil {
		t.Fatalf("not ready after the stream was fixed: %v", rl.StreamProblem())
	}
}
