package relay_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

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

// A stream check that gets no answer in time learnt nothing about the
// streams. On a loaded machine (a starved NATS server answering stream
// info after the check's deadline) such a check turned the relay not ready
// with an error saying a stream had changed under it, though nothing had:
// found by internal/grouptest beside six busy loops. Here the server's
// answers are held back until a check has run into its deadline: the
// relay stays ready, names no stream problem, and says the check could not
// read the streams. Held back for three checks in a row (a server that
// will not answer, as one without JetStream), the relay is not ready,
// saying why, and ready again once a check reads the streams.
func TestRelayStreamCheckWithoutAnswerKeepsVerdict(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	proxy, err := testenv.StartProxy(strings.TrimPrefix(testenv.Get(t).NATS.URL, "nats://"))
	testenv.Must(t, err, "proxy")
	t.Cleanup(proxy.Close)
	f := newFixture(t, fmt.Sprintf("nats://127.0.0.1:%d", proxy.Port()))
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	core, logs := observer.New(zapcore.InfoLevel)
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core)).Named("relay")
	var ready, dropped atomic.Bool
	rl, _ := f.Start(ctx, relay.WithLogger(log), relay.WithReadiness(func(r bool) {
		if ready.Swap(r) && !r {
			dropped.Store(true)
		}
	}))
	if !testenv.WaitFor(30*time.Second, ready.Load) {
		t.Fatal("never ready")
	}
	proxy.Stall(testenv.Downstream)
	unread := func() bool { return logs.FilterMessageSnippet("could not check the streams").Len() > 0 }
	ok := testenv.WaitFor(30*time.Second, func() bool { return unread() || dropped.Load() })
	proxy.Heal()
	if !ok {
		t.Fatal("no stream check ran into its deadline within 30s")
	}
	if dropped.Load() || rl.StreamProblem() != nil {
		t.Fatalf("a stream check without an answer made the relay not ready (%q); stream problem %v", rl.NotReadyReason(), rl.StreamProblem())
	}
	if !testenv.WaitFor(30*time.Second, func() bool { return logs.FilterMessage("stream checks read the streams again").Len() > 0 }) {
		t.Fatal("the stream checks never read the streams again after the server answered")
	}
	if dropped.Load() || !ready.Load() {
		t.Fatalf("not ready after the stream checks read the streams again: %q", rl.NotReadyReason())
	}

	proxy.Stall(testenv.Downstream)
	ok = testenv.WaitFor(2*time.Minute, func() bool { return !ready.Load() })
	reason, unreadErr := rl.NotReadyReason(), rl.StreamsUnread()
	proxy.Heal()
	if !ok {
		t.Fatal("still ready after two minutes of stream checks that cannot read the streams")
	}
	if unreadErr == nil || !strings.Contains(reason, "could not be read in 3 checks in a row") || rl.StreamProblem() != nil {
		t.Fatalf("not ready for %q (unread: %v, stream problem: %v), want the streams unread", reason, unreadErr, rl.StreamProblem())
	}
	if !testenv.WaitFor(30*time.Second, ready.Load) || rl.StreamsUnread() != nil {
		t.Fatalf("not ready after the server answered again: %q", rl.NotReadyReason())
	}
}
